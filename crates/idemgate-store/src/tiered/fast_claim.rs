//! The fast-layer half of a claim: one atomic round trip that answers a
//! replay or "in flight" without SQL, or places this request's marker.

use super::Store;
use crate::codec::FastEntry;
use crate::{Claim, RecordKey, now_ms};

/// What the fast-layer half of a claim found.
pub(super) enum FastClaim {
    /// The fast layer answers this request (a replay, or in flight).
    Answered(Claim),
    /// This request's in-flight marker is placed: SQL decides.
    Marked,
    /// Nothing usable there (another request's value, a failed layer, no
    /// fast layer): SQL decides.
    ToSql,
}

impl Store {
    /// The fast-layer half of a claim, one atomic round trip: what is
    /// stored there for this request (a completed answer, an in-flight
    /// marker), or this request's marker placed.
    pub(super) async fn claim_in_fast_layer(
        &self,
        key: &RecordKey,
        fingerprint: &str,
    ) -> FastClaim {
        let Some(fast) = &self.fast else {
            return FastClaim::ToSql;
        };
        let marker = FastEntry::InFlight {
            key: key.clone(),
            fingerprint: fingerprint.to_owned(),
            expires_at_ms: crate::after_ms(now_ms(), self.settings.retention),
        };
        let found = self
            .fast(
                "get_or_mark",
                fast.get_or_mark(&marker, self.settings.lease),
            )
            .await;
        match found {
            Some(None) => FastClaim::Marked,
            Some(Some((entry, _))) if entry.key() == key && entry.fingerprint() == fingerprint => {
                FastClaim::Answered(match entry {
                    FastEntry::Completed {
                        response,
                        expires_at_ms,
                        ..
                    } => Claim::Completed {
                        response,
                        expires_at_ms,
                    },
                    FastEntry::InFlight { expires_at_ms, .. } => {
                        // Placed before the layer moved to another server:
                        // maybe stale, so SQL is asked (see
                        // `FastLayer::moved_at`).
                        if fast
                            .moved_at()
                            .is_some_and(|at| at.elapsed() < self.settings.lease)
                        {
                            return FastClaim::ToSql;
                        }
                        Claim::InFlight {
                            retry_after: self.settings.lease,
                            expires_at_ms,
                        }
                    }
                })
            }
            Some(Some((entry, _))) if entry.key() != key => {
                // A value that is not ours under our key: never trust it,
                // let SQL decide, and count it.
                self.metrics.fallback(fast.layer());
                tracing::warn!(route = %key.route, key = %key.escaped(), layer = "fast", "foreign fast-layer value ignored");
                FastClaim::ToSql
            }
            // Another fingerprint (SQL answers 422), or the layer failed.
            Some(Some(_)) | None => FastClaim::ToSql,
        }
    }
}
