//! The `idemgate` binary; the command line is [`idemgate_cli::cli::idemgate`].

/// jemalloc instead of glibc malloc: the proxy path allocates and frees
/// many small buffers per request (header maps, body frames, boxed
/// futures); jemalloc costs the fewest instructions per request within the
/// memory budget (the comparison is in `loadtest/README.md`).
#[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> std::process::ExitCode {
    // Without a background thread jemalloc returns freed pages to the
    // kernel only from inside later allocations, so a gateway that goes
    // quiet after a burst of large answers keeps the burst's pages resident
    // for as long as it stays quiet; the background thread purges them on
    // jemalloc's decay schedule (pages unused for `dirty_decay_ms`, 10 s by
    // default). Set before any worker thread starts.
    #[cfg(all(feature = "jemalloc", not(target_env = "msvc")))]
    if let Err(e) = tikv_jemalloc_ctl::background_thread::write(true) {
        eprintln!("idemgate: jemalloc background thread not started: {e}");
    }
    idemgate_cli::cli::idemgate()
}
