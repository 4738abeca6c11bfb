//! The command lines of Idemgate's two binaries: `idemgate` (serve, demo,
//! check-config, migrate, keys, sweep) and `demo-upstream`, over the
//! workspace's crates. This package is not published; the library is the
//! `idemgate` crate.

pub mod cli;
mod demo;

/// The repository's README, compiled as a doc test: its library quick
/// start must build.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDocTest;
