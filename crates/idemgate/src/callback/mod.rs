//! Callback routes: payment notifications, MQ pushes and job retries, whose
//! callers never carry a client token. They dedupe on a business key taken
//! from the request (payment serial, msgId + topic), through the same engine
//! as the synchronous routes, after an optional signature check.

mod key;
mod policy;
pub mod signature;

pub use key::{
    BusinessKeyError, KeySource, MAX_KEY_BYTES, business_key, check_key_value, join_key_values,
    match_values,
};
pub use policy::{CallbackPolicy, ROUTE_SCOPE};
pub use signature::{SignatureError, SignatureScheme, SignatureSpec, Verifier};
