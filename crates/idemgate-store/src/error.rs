//! [`StoreError`]: why a store operation failed (every variant means "fail
//! closed"), and the answer a client gets for it.

use std::time::Duration;

/// Why a store operation failed. Every variant means "fail closed".
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database refused or dropped the operation.
    #[error("SQL store unavailable during {op}: {cause}")]
    Unavailable {
        /// The operation (`claim`, `complete`, `connect`, …).
        op: &'static str,
        /// The database's error, its URL credentials redacted.
        cause: String,
    },
    /// The database did not answer within the store timeout.
    #[error("SQL store did not answer {op} within {after:?}")]
    Timeout {
        /// The operation (`claim`, `complete`, `connect`, …).
        op: &'static str,
        /// The store timeout that passed.
        after: Duration,
    },
    /// A record could not be decoded.
    #[error("stored record is corrupt: {0}")]
    Corrupt(String),
    /// The schema migrations could not be applied.
    #[error("migrations failed: {0}")]
    Migrate(String),
}

/// Its answer to the client: the one problem type every module maps to.
impl From<&StoreError> for idemgate_core::error::Problem {
    fn from(e: &StoreError) -> Self {
        idemgate_core::error::Problem::new(idemgate_core::error::Reason::StoreUnavailable)
            .detail("the request was not forwarded; retry later with the same key")
            .retry_after(1)
            .logged("store", e.to_string())
    }
}
