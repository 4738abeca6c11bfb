//! The `demo-upstream` binary; the command line is
//! [`idemgate_cli::cli::demo_upstream`].

fn main() -> std::process::ExitCode {
    idemgate_cli::cli::demo_upstream()
}
