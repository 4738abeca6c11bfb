//! How a forward failed, as the innermost service (the gateway's proxy, or
//! anything that forwards) tells the policy layers above it: the one fact a
//! claim's holder needs to decide between releasing the claim and marking
//! its outcome uncertain.

/// How a forward failed, set by the inner service (the proxy) on its error
/// response, so that the holder knows what the failure means for a claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardFailure {
    /// The upstream never received the request: safe to execute again.
    NotSent,
    /// The request may have reached the upstream, but no complete answer
    /// came back (timeout, reset): the outcome is uncertain.
    Uncertain,
}
