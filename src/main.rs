//! The `idemgate` binary; the command line is [`idemgate_cli::cli::idemgate`].

/// jemalloc instead of glibc malloc: the proxy path allocates and frees
/// many small buffers per request (header maps, body frames, boxed
/// futures); jemalloc costs the fewest instructions per request within the
/// memory budget (the comparison is in `loadtest/README.md`).
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    idemgate_cli::cli::idemgate()
}
