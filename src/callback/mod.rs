//! Callback routes: payment notifications, MQ pushes and job retries, whose
//! callers never carry a client token. They dedupe on a business key taken
//! from the request.

mod key;

pub use key::KeySource;
