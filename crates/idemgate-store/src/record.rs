//! The record vocabulary every part of the store speaks: which record
//! ([`RecordKey`]), where it stands ([`RecordState`]), what it holds
//! ([`Record`], [`StoredResponse`]) and what a claim found ([`Claim`]), with
//! the clock helpers they are read by. It depends on nothing else in the
//! crate, so every module can import it and none imports the assembly.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;

use crate::StoreError;

/// Which record: (client scope, route, key) — docs/semantics.md, rule 4.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    /// Hash of the client identity (see [`idemgate_core::identity`]).
    pub scope: String,
    /// The route name.
    pub route: String,
    /// The client's key, the token id, or the business key.
    pub key: String,
}

impl RecordKey {
    /// A key from its three parts.
    pub fn new(scope: impl Into<String>, route: impl Into<String>, key: impl Into<String>) -> Self {
        RecordKey {
            scope: scope.into(),
            route: route.into(),
            key: key.into(),
        }
    }

    /// The key as logs show it: never raw, see [`key_ref`].
    pub fn escaped(&self) -> String {
        key_ref(&self.key)
    }
}

/// How logs name a client's key: its first 4 characters, escaped, and a
/// short hash of the whole (`abcd…#1a2b3c4d`). Enough to tell keys apart
/// and to match `keys show` output, never enough to reuse the key.
pub fn key_ref(key: &str) -> String {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(key.as_bytes());
    let prefix: String = key.chars().take(4).collect();
    format!("{}…#{}", prefix.escape_debug(), hex::encode(&hash[..4]))
}

/// Where a record stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordState {
    /// A holder has the claim and works under a lease.
    InFlight,
    /// The outcome is stored and replayed.
    Completed,
    /// The request reached the upstream and no answer came back.
    Uncertain,
    /// The attempt had no effect: the next request takes the key over.
    Released,
}

impl RecordState {
    /// The column value.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RecordState::InFlight => "in_flight",
            RecordState::Completed => "completed",
            RecordState::Uncertain => "uncertain",
            RecordState::Released => "released",
        }
    }

    pub(crate) fn parse(text: &str) -> Result<RecordState, StoreError> {
        Ok(match text {
            "in_flight" => RecordState::InFlight,
            "completed" => RecordState::Completed,
            "uncertain" => RecordState::Uncertain,
            "released" => RecordState::Released,
            other => return Err(StoreError::Corrupt(format!("unknown state {other:?}"))),
        })
    }
}

/// A finished request's outcome, as replayed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// End-to-end headers, in order (no hop-by-hop, no `Set-Cookie`).
    pub headers: Vec<(String, Vec<u8>)>,
    /// Trailer fields, in order: a gRPC answer's status (`grpc-status`,
    /// `grpc-message`) and trailing metadata. Empty for most HTTP answers.
    pub trailers: Vec<(String, Vec<u8>)>,
    /// The body (empty when not kept).
    pub body: Bytes,
    /// False when the body was over `store.max_stored_body_bytes`: the
    /// outcome is recorded (never re-executed) but the body is not kept.
    pub body_kept: bool,
    /// The `X-Request-Id` of the request that produced it.
    pub request_id: String,
}

/// One record as stored.
#[derive(Debug, Clone)]
pub struct Record {
    /// Which record.
    pub key: RecordKey,
    /// The claiming request's fingerprint (method, path, query, body).
    pub fingerprint: String,
    /// Where it stands.
    pub state: RecordState,
    /// The fencing token: grows with every takeover.
    pub epoch: i64,
    /// Until when its claim (or an uncertain record's hold) lasts, ms.
    pub lease_until_ms: i64,
    /// The `X-Request-Id` of the request that claimed it.
    pub request_id: String,
    /// The stored outcome, once completed.
    pub response: Option<StoredResponse>,
    /// When its key was first claimed (or claimed afresh), ms.
    pub created_at_ms: i64,
    /// When it last changed, ms.
    pub updated_at_ms: i64,
    /// When its retention ends, ms.
    pub expires_at_ms: i64,
    /// When its tombstone ends (`expires_at_ms` when tombstones are off):
    /// between the two, the key answers 410 for the same request.
    pub forgotten_at_ms: i64,
    /// The database's clock when the record was read: leases and expiries
    /// are judged against it, never against this gateway's clock.
    pub read_at_ms: i64,
}

/// What a claim found. Every answer about an existing record carries the
/// record's expiry (`Idempotency-Expires`), in ms since the Unix epoch by
/// the database's clock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// This request holds the claim under `epoch`: forward it.
    Won {
        /// The claim's fencing epoch.
        epoch: i64,
        /// The record's expiry.
        expires_at_ms: i64,
        /// The attempt this claim replaced may have reached the upstream
        /// (it was uncertain, or its holder's lease ran out): ask the
        /// upstream before forwarding again, where the route can.
        maybe_ran: bool,
    },
    /// Another request with this key is running.
    InFlight {
        /// How long the claim may still be held.
        retry_after: Duration,
        /// The record's expiry.
        expires_at_ms: i64,
    },
    /// The same request reached the upstream and no answer came back; a
    /// copy may still be running there for `retry_after`, and until then
    /// nothing is forwarded (docs/semantics.md, rule 8).
    Uncertain {
        /// The uncertain attempt's epoch (a reconciled answer is fenced
        /// by it).
        epoch: i64,
        /// How long the hold lasts.
        retry_after: Duration,
        /// The record's expiry.
        expires_at_ms: i64,
    },
    /// The request already finished: replay this.
    Completed {
        /// The stored outcome.
        response: StoredResponse,
        /// The record's expiry.
        expires_at_ms: i64,
    },
    /// The key was used for a different request.
    Mismatch {
        /// The record's expiry.
        expires_at_ms: i64,
    },
    /// The same request, after its record's retention, within its
    /// tombstone (`store.tombstone`): 410, never executed again.
    Expired {
        /// When the tombstone ends.
        forgotten_at_ms: i64,
    },
}

impl Claim {
    /// Until when the answer's record is remembered: its retention's end,
    /// or for a tombstone the tombstone's end.
    #[cfg_attr(feature = "testing", visibility::make(pub))]
    #[cfg(any(test, feature = "testing"))]
    pub(crate) fn expires_at_ms(&self) -> i64 {
        match self {
            Claim::Won { expires_at_ms, .. }
            | Claim::InFlight { expires_at_ms, .. }
            | Claim::Uncertain { expires_at_ms, .. }
            | Claim::Completed { expires_at_ms, .. }
            | Claim::Mismatch { expires_at_ms } => *expires_at_ms,
            Claim::Expired { forgotten_at_ms } => *forgotten_at_ms,
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default()
}

/// Milliseconds of a duration, for the statements' duration parameters.
pub(crate) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX / 4)
}

/// Adds a duration to a millisecond timestamp.
pub fn after_ms(base: i64, d: Duration) -> i64 {
    base.saturating_add(d.as_millis().min(i64::MAX as u128) as i64)
}

impl Record {
    /// Whether the record is held under a live lease (by the database's
    /// clock when it was read).
    ///
    /// Uncertain records count while their hold runs (a copy may still be
    /// running at the upstream): neither the sweeper nor a purge removes a
    /// held record.
    pub(crate) fn is_held(&self) -> bool {
        matches!(self.state, RecordState::InFlight | RecordState::Uncertain)
            && self.lease_until_ms > self.read_at_ms
    }

    /// The record for operators (`idemgate keys show`, `/admin/keys`):
    /// state, epoch, lease, fingerprint, stored status and ages.
    pub fn describe(&self) -> serde_json::Value {
        let now = self.read_at_ms;
        let age = |ms: i64| format!("{:.1}s", (now - ms) as f64 / 1000.0);
        let left = |ms: i64| format!("{:.1}s", (ms - now) as f64 / 1000.0);
        // Past its retention a record only says "expired" (tombstone) or is
        // waiting for the sweep; its stored state stays what it was.
        let phase = if self.expires_at_ms > now || self.is_held() {
            "live"
        } else if self.forgotten_at_ms > now {
            "tombstone"
        } else {
            "forgotten"
        };
        serde_json::json!({
            "route": self.key.route,
            "key": self.key.key,
            "client_scope": self.key.scope,
            "state": self.state.as_str(),
            "phase": phase,
            "epoch": self.epoch,
            "lease_left": if self.state == RecordState::InFlight { Some(left(self.lease_until_ms)) } else { None },
            // An uncertain record is not taken over before this.
            "hold_left": if self.state == RecordState::Uncertain && self.lease_until_ms > now { Some(left(self.lease_until_ms)) } else { None },
            "fingerprint": self.fingerprint,
            "request_id": self.request_id,
            "stored_status": self.response.as_ref().map(|r| r.status),
            "stored_body_bytes": self.response.as_ref().map(|r| r.body.len()),
            "body_kept": self.response.as_ref().map(|r| r.body_kept),
            "age": age(self.created_at_ms),
            "updated": age(self.updated_at_ms),
            "expires_in": left(self.expires_at_ms),
            "forgotten_in": left(self.forgotten_at_ms),
        })
    }
}
