//! Connection-specific ("hop-by-hop") headers, RFC 9110 §7.6.1: what the
//! proxy never forwards and the engine never stores for replay. Shared at
//! the bottom of the crate so that the engine does not depend on the proxy.

use http::{HeaderName, header};

/// Headers that describe one connection, never the message (RFC 9110 §7.6.1).
pub static HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

/// Whether `name` is one of [`HOP_BY_HOP`]. Spelled out rather than
/// searched: it runs for every header of every request and answer, and
/// comparing against standard names is a tag comparison.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    *name == header::CONNECTION
        || *name == header::TE
        || *name == header::TRAILER
        || *name == header::TRANSFER_ENCODING
        || *name == header::UPGRADE
        || *name == header::PROXY_AUTHORIZATION
        || matches!(name.as_str(), "keep-alive" | "proxy-connection")
}
