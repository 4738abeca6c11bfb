//! The `demo-upstream` binary; the command line is
//! [`idemgate::cli::demo_upstream`].

fn main() -> std::process::ExitCode {
    idemgate::cli::demo_upstream()
}
