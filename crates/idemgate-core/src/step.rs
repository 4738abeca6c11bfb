//! [`await_boxed!`](crate::await_boxed): awaits a step of an `async fn` in
//! a box of its own.
//!
//! An `async fn`'s future holds the state of every `.await` in it side by
//! side more often than overlapped, and it is moved whole: into a box, into
//! a spawned task, into a `tracing` wrapper. The gateway's claim task
//! measured 81 KB that way, copied several times per first request and far
//! larger than a core's L1 cache. Awaiting a large step through a box keeps
//! only a pointer in the caller's state; the step's own state is allocated
//! when it starts, once.
//!
//! `Box::pin(step).await` is not enough: the unboxed temporary is stored in
//! the caller's state until the end of the statement, across the `.await`.
//! The macro builds the box in a block of its own, where the temporary ends
//! before anything is awaited.

/// Awaits `$step` (a future) in a box of its own; see the module docs.
#[macro_export]
macro_rules! await_boxed {
    ($step:expr $(,)?) => {{
        let step = { ::std::boxed::Box::pin($step) };
        step.await
    }};
}

#[cfg(test)]
mod tests {
    async fn large() -> u8 {
        let buffer = [7u8; 16 * 1024];
        tokio::task::yield_now().await;
        buffer[16 * 1024 - 1]
    }

    async fn boxed() -> u8 {
        crate::await_boxed!(large())
    }

    async fn inline() -> u8 {
        large().await
    }

    #[tokio::test]
    async fn a_boxed_step_keeps_only_a_pointer_in_the_callers_state() {
        assert!(std::mem::size_of_val(&inline()) > 16 * 1024);
        assert!(std::mem::size_of_val(&boxed()) < 256);
        assert_eq!(boxed().await, 7);
    }
}
