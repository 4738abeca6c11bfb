//! Hop-by-hop stripping and the `X-Forwarded-*` headers.

use std::net::IpAddr;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// Headers that describe one connection, never the message (RFC 9110 §7.6.1).
pub const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::PROXY_AUTHORIZATION,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Removes the hop-by-hop headers, and first every header that `Connection`
/// names (those are hop-by-hop for this one message too).
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|token| HeaderName::from_bytes(token.trim().as_bytes()).ok())
        .collect();
    for name in named {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Prepares request headers for the upstream: strips hop-by-hop headers,
/// appends the client to `X-Forwarded-For`, and moves `Host` to
/// `X-Forwarded-Host` (the client sets `Host` to the upstream's authority).
pub(super) fn prepare_request(headers: &mut HeaderMap, client: Option<IpAddr>) {
    strip_hop_by_hop(headers);
    if let Some(ip) = client {
        let value = match headers.get(&X_FORWARDED_FOR).and_then(|v| v.to_str().ok()) {
            Some(prior) if !prior.trim().is_empty() => format!("{prior}, {ip}"),
            _ => ip.to_string(),
        };
        if let Ok(v) = HeaderValue::from_str(&value) {
            headers.insert(X_FORWARDED_FOR, v);
        }
    }
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static("http"));
    match headers.remove(header::HOST) {
        Some(host) => {
            headers.insert(X_FORWARDED_HOST, host);
        }
        None => {
            headers.remove(X_FORWARDED_HOST);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_standard_and_connection_named_headers() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, X-Secret-Hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TE, "trailers".parse().unwrap());
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        h.insert("x-end-to-end", "kept".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1, "{h:?}");
        assert_eq!(h["x-end-to-end"], "kept");
    }

    #[test]
    fn forwarded_for_is_appended() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, "10.0.0.1".parse().unwrap());
        h.insert(header::HOST, "shop.example".parse().unwrap());
        prepare_request(&mut h, Some("127.0.0.1".parse().unwrap()));
        assert_eq!(h[X_FORWARDED_FOR], "10.0.0.1, 127.0.0.1");
        assert_eq!(h[X_FORWARDED_HOST], "shop.example");
        assert_eq!(h[X_FORWARDED_PROTO], "http");
        assert!(h.get(header::HOST).is_none());
    }
}
