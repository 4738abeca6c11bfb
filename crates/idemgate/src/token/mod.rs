//! One-time tokens: `/token` issues them, token routes consume them.
//!
//! A token is self-verifying: `v1.<payload>.<mac>`, where the payload holds
//! a random 128-bit id, the expiry and the route it is bound to (if any), and
//! the MAC is HMAC-SHA256 over the payload *and the client's scope*. So a
//! forged, altered, other-client or other-route token fails verification
//! with a 403 before any store access, and issuing a token writes nothing.
//! The first use claims the token id through the shared engine; a used token
//! keeps replaying its outcome for the retention period, even past its own
//! expiry (an expired token is only ever looked up, never claimed, and only
//! after its MAC checked out). The MAC binds the client's principal, not its
//! credential's bytes (see [`idemgate_core::identity`]): a refreshed credential still
//! uses its token. Secrets rotate (`tokens.secrets`: sign with the first,
//! verify with any), and issuing may be rate-limited per principal
//! ([`IssueLimit`]).

mod codec;
mod endpoint;
mod limit;
mod policy;

pub use codec::{TokenClaims, TokenError, TokenKeys};
pub use endpoint::TokenEndpoint;
pub use limit::{IssueLimit, MAX_PRINCIPALS};
pub use policy::{IDEMPOTENCY_TOKEN, TOKEN_RECORDS, TokenPolicy};
