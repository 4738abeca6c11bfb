//! Which request headers reach the upstream: hop-by-hop filtering and the
//! `X-Forwarded-*` headers, and which answer headers reach the client.

use http::header::{self, HeaderMap, HeaderName, HeaderValue};

pub use idemgate_core::hop_by_hop::{HOP_BY_HOP, is_hop_by_hop};

pub use idemgate_core::client_addr::ClientAddr;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

/// Whether the gateway sets `name` for the upstream itself (the stable
/// `Idempotency-Key`, `X-Request-Id`, `X-Forwarded-*`, `Forwarded`, a gRPC
/// call's `grpc-timeout`, and
/// with traces on `traceparent` and `tracestate`). By the
/// time the request is written these hold the gateway's values, not the
/// client's, so a client's `Connection` must never name them away (docs/semantics.md,
/// rule 7, §4 Always): listed there, they are ignored as options.
fn is_set_by_gateway(name: &HeaderName) -> bool {
    *name == header::FORWARDED
        || matches!(
            name.as_str(),
            "idempotency-key"
                | "grpc-timeout"
                | "x-request-id"
                | "x-forwarded-for"
                | "x-forwarded-proto"
                | "x-forwarded-host"
        )
        // With traces on, the trace context is the gateway's upstream span.
        || (idemgate_core::trace::enabled()
            && matches!(name.as_str(), "traceparent" | "tracestate"))
}

/// The header names `Connection` lists: hop-by-hop for this one message
/// too, so the client's headers of those names are not forwarded. The
/// options `close` and `keep-alive` are skipped (a `Keep-Alive` header is
/// hop-by-hop anyway), and so are the names the gateway sets itself
/// ([`is_set_by_gateway`]): a client cannot strip the gateway's own
/// headers. Empty, without allocating, when there is no `Connection`
/// header: the check is a pass over the names, cheaper than a hashed
/// lookup.
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    if !headers.keys().any(|name| *name == header::CONNECTION) {
        return Vec::new();
    }
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|t| !t.eq_ignore_ascii_case("close") && !t.eq_ignore_ascii_case("keep-alive"))
        .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
        .filter(|name| !is_set_by_gateway(name))
        .collect()
}

/// Whether the client's `TE` lists `trailers` (RFC 9110 §10.1.4).
pub(super) fn asks_for_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|coding| {
            coding
                .split(';')
                .next()
                .is_some_and(|name| name.trim().eq_ignore_ascii_case("trailers"))
        })
}

/// Turns the client's headers into the upstream's, in place (the map is
/// the request's own; rebuilding it would cost a copy per header): the
/// hop-by-hop headers and those `Connection` names go (never the gateway's
/// own `Idempotency-Key`, `X-Request-Id` or `X-Forwarded-*`, whatever
/// `Connection` lists); `Host` becomes `upstream_host` over HTTP/1.1 (and
/// goes over HTTP/2, where `:authority` names the upstream), and the
/// client's `Host` moves to `X-Forwarded-Host` (`authority`, the request
/// target's, stands for it on HTTP/2: RFC 9113 §8.3.1); the client is
/// appended to `X-Forwarded-For`; `X-Forwarded-Proto` is how the client
/// reached the gateway. `Content-Length` goes because the client frames
/// the body it actually sends, and `Expect` because the gateway already
/// answered `100-continue` and sends the body without waiting. (Long by
/// design: one pass over the headers, each rule beside its reason.)
pub(super) fn filter_request_headers(
    headers: &mut HeaderMap,
    client: Option<&ClientAddr>,
    authority: Option<&http::uri::Authority>,
    upstream_host: Option<HeaderValue>,
) {
    let named = connection_named(headers);
    // `TE: trailers` is the one `TE` HTTP/2 allows (RFC 9113 §8.2.2), and
    // gRPC servers refuse a call without it; the gateway relays trailers,
    // so it says so to an HTTP/2 upstream when the client did.
    let te_trailers = upstream_host.is_none() && asks_for_trailers(headers);
    let dropped = |name: &HeaderName| {
        *name == header::CONTENT_LENGTH
            || *name == header::EXPECT
            || is_hop_by_hop(name)
            || named.contains(name)
    };
    // One pass of tag comparisons; a hashed removal only for what is there.
    if headers.keys().any(dropped) {
        let doomed: Vec<HeaderName> = headers.keys().filter(|n| dropped(n)).cloned().collect();
        for name in &doomed {
            headers.remove(name);
        }
    }
    // HTTP/2 splits cookies into crumbs; an HTTP/1.1 upstream must get
    // them as one header (RFC 9113 §8.2.3).
    // (`len() > keys_len()` says some name has several values: free to
    // check, where looking cookies up would hash on every request.)
    if upstream_host.is_some()
        && headers.len() > headers.keys_len()
        && let http::header::Entry::Occupied(mut cookies) = headers.entry(header::COOKIE)
        && cookies.iter().nth(1).is_some()
    {
        let crumbs: Vec<HeaderValue> = cookies.iter().cloned().collect();
        let mut text = Vec::new();
        for (i, crumb) in crumbs.iter().enumerate() {
            if i > 0 {
                text.extend_from_slice(b"; ");
            }
            text.extend_from_slice(crumb.as_bytes());
        }
        if let Ok(one) = HeaderValue::from_bytes(&text) {
            cookies.insert(one);
        }
    }
    if te_trailers {
        headers.insert(header::TE, HeaderValue::from_static("trailers"));
    }
    let client_host = match upstream_host {
        Some(host) => headers.insert(header::HOST, host),
        None => headers.remove(header::HOST),
    };
    let forwarded_host =
        client_host.or_else(|| authority.and_then(|a| HeaderValue::from_str(a.as_str()).ok()));
    match &forwarded_host {
        Some(host) => headers.insert(X_FORWARDED_HOST, host.clone()),
        None => headers.remove(X_FORWARDED_HOST),
    };
    let proto = if client.is_some_and(|c| c.is_secure()) {
        "https"
    } else {
        "http"
    };
    headers.insert(X_FORWARDED_PROTO, HeaderValue::from_static(proto));
    if let Some(client) = client {
        match headers.entry(X_FORWARDED_FOR) {
            http::header::Entry::Vacant(entry) => {
                entry.insert(client.ip_text().clone());
            }
            http::header::Entry::Occupied(mut entry) => {
                let mut prior: Vec<HeaderValue> = entry
                    .iter()
                    .filter(|v| !v.as_bytes().trim_ascii().is_empty())
                    .cloned()
                    .collect();
                prior.push(client.ip_text().clone());
                let parts: Vec<&[u8]> = prior.iter().map(HeaderValue::as_bytes).collect();
                entry.insert(joined(&parts));
            }
        }
        // A client's `Forwarded` (RFC 7239) gets the gateway's element
        // appended, as X-Forwarded-For does: the last element is always
        // what the gateway saw, never what a client claims. (Not added
        // when the client sent none: upstreams read X-Forwarded-*.)
        if let http::header::Entry::Occupied(mut entry) = headers.entry(header::FORWARDED) {
            // A value that is not RFC 7239 (an open quote, a stray
            // separator) could swallow the element appended after it:
            // such a header is dropped, and only the gateway's is sent.
            if !entry.iter().all(|v| is_forwarded(v.as_bytes())) {
                entry.insert(HeaderValue::from_static(""));
            }
            let mut element = Vec::with_capacity(64);
            element.extend_from_slice(b"for=");
            if client.addr.is_ipv6() {
                element.extend_from_slice(b"\"[");
                element.extend_from_slice(client.ip_text().as_bytes());
                element.extend_from_slice(b"]\"");
            } else {
                element.extend_from_slice(client.ip_text().as_bytes());
            }
            element.extend_from_slice(b";proto=");
            element.extend_from_slice(proto.as_bytes());
            if let Some(host) = &forwarded_host
                && is_plain_host(host.as_bytes())
            {
                element.extend_from_slice(b";host=\"");
                element.extend_from_slice(host.as_bytes());
                element.push(b'"');
            }
            let mut parts: Vec<&[u8]> = entry
                .iter()
                .map(HeaderValue::as_bytes)
                .filter(|v| !v.trim_ascii().is_empty())
                .collect();
            parts.push(&element);
            let value = joined(&parts);
            entry.insert(value);
        }
    }
}

/// Whether `value` is an RFC 7239 `Forwarded` value: elements separated by
/// commas, pairs by semicolons, each `token=token` or `token="quoted"`.
fn is_forwarded(value: &[u8]) -> bool {
    fn tchar(b: u8) -> bool {
        b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b)
    }
    let mut i = 0;
    let n = value.len();
    let skip_ws = |i: &mut usize| {
        while *i < n && matches!(value[*i], b' ' | b'\t') {
            *i += 1;
        }
    };
    loop {
        skip_ws(&mut i);
        let start = i;
        while i < n && tchar(value[i]) {
            i += 1;
        }
        if i == start || i >= n || value[i] != b'=' {
            return false;
        }
        i += 1;
        if i < n && value[i] == b'"' {
            i += 1;
            loop {
                match value.get(i) {
                    None => return false,
                    Some(b'"') => break,
                    Some(b'\\') => i += 2,
                    Some(b) if b.is_ascii_control() && *b != b'\t' => return false,
                    Some(_) => i += 1,
                }
            }
            i += 1;
        } else {
            let start = i;
            while i < n && tchar(value[i]) {
                i += 1;
            }
            if i == start {
                return false;
            }
        }
        skip_ws(&mut i);
        match value.get(i) {
            None => return true,
            Some(b';' | b',') => i += 1,
            Some(_) => return false,
        }
    }
}

/// Whether a `Host` is a plain `name[:port]` or `[v6][:port]`: only then
/// does it go into `Forwarded`'s `host=` (a `,` or `;` in it would read as
/// a new element to a parser that splits without quotes).
fn is_plain_host(host: &[u8]) -> bool {
    !host.is_empty()
        && host
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b':' | b'[' | b']'))
}

/// Several header values as one, joined with `, `.
fn joined(values: &[&[u8]]) -> HeaderValue {
    if let [one] = values
        && let Ok(value) = HeaderValue::from_bytes(one)
    {
        return value;
    }
    let mut text = Vec::with_capacity(values.iter().map(|v| v.len() + 2).sum());
    for (i, value) in values.iter().enumerate() {
        if i > 0 {
            text.extend_from_slice(b", ");
        }
        text.extend_from_slice(value);
    }
    // Made of valid header values and ", ": valid.
    HeaderValue::from_bytes(&text).unwrap_or_else(|_| HeaderValue::from_static(""))
}

/// Copies every header value into one small allocation of the map's own.
///
/// hyper parses a message's header values as slices of its connection's
/// read buffer (8 KiB, HTTP/1.1) or frame buffer (HTTP/2), so one value
/// kept keeps that whole buffer alive. An HTTP/2 peer's HPACK encoder keeps
/// the values it indexes for as long as its connection lives: an upstream's
/// `Date` alone is a new entry every second, up to about sixty entries in a
/// 4 KiB table, and each would pin a whole buffer: about half a megabyte
/// per HTTP/2 client connection (measured in `loadtest/README.md`).
pub(super) fn detach_values(headers: &mut HeaderMap) {
    let total: usize = headers.values().map(HeaderValue::len).sum();
    let mut buffer = bytes::BytesMut::with_capacity(total);
    for value in headers.values_mut() {
        buffer.extend_from_slice(value.as_bytes());
        // The same bytes as a value that was valid: cannot fail.
        if let Ok(mut own) = HeaderValue::from_maybe_shared(buffer.split().freeze()) {
            own.set_sensitive(value.is_sensitive());
            *value = own;
        }
    }
}

/// Removes what describes the upstream connection from an answer: the
/// hop-by-hop headers and those its `Connection` names. An answer with a
/// transfer coding other than `chunked` (hyper has removed the chunking)
/// is refused: the coding is hop-by-hop, so relaying the bytes without it
/// would hand the client a body it cannot read, and no client asked for
/// one (nginx refuses it too). Returns whether the answer was framed two
/// ways (`Transfer-Encoding` and `Content-Length`), whose connection is not
/// trusted again.
///
/// One pass over the names (tag comparisons) decides what to do; hashed
/// removals happen only for headers that are there. Nearly every upstream
/// sends `Connection: keep-alive`, so this runs on nearly every answer.
/// The trailer fields an HTTP/1.1 client that asked for trailers is told
/// to expect (hyper writes only the fields `Trailer` names, RFC 9110
/// §6.6.2): those the upstream named, and for a gRPC answer the status
/// fields, which an HTTP/2 upstream has no need to announce. `None` when
/// there are none.
pub(super) fn trailer_names(upstream: &HeaderMap) -> Option<HeaderValue> {
    let mut names: Vec<&str> = upstream
        .get_all(header::TRAILER)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .collect();
    if idemgate_core::grpc::is_grpc(upstream) {
        for grpc in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
            if !names.iter().any(|n| n.eq_ignore_ascii_case(grpc)) {
                names.push(grpc);
            }
        }
    }
    if names.is_empty() {
        return None;
    }
    HeaderValue::from_str(&names.join(", ")).ok()
}

pub(super) fn strip_response_headers(headers: &mut HeaderMap) -> Result<bool, String> {
    let (mut chunked, mut length, mut hops) = (false, false, 0usize);
    for name in headers.keys() {
        if *name == header::TRANSFER_ENCODING {
            chunked = true;
        } else if *name == header::CONTENT_LENGTH {
            length = true;
        }
        if is_hop_by_hop(name) {
            hops += 1;
        }
    }
    if chunked {
        for coding in headers.get_all(header::TRANSFER_ENCODING) {
            let text = coding.to_str().unwrap_or("?");
            if text
                .split(',')
                .map(str::trim)
                .any(|c| !c.eq_ignore_ascii_case("chunked"))
            {
                return Err(format!("the upstream sent Transfer-Encoding: {text}"));
            }
        }
        if length {
            // The chunking decided the length (RFC 9112 §6.3); a length
            // beside it would misframe the answer to the client.
            headers.remove(header::CONTENT_LENGTH);
        }
    }
    if hops == 0 {
        return Ok(chunked && length);
    }
    let mut doomed: Vec<HeaderName> = Vec::with_capacity(hops);
    for value in headers.get_all(header::CONNECTION) {
        let Ok(text) = value.to_str() else { continue };
        for token in text.split(',').map(str::trim) {
            // The options are not header names (`keep-alive` is removed
            // as hop-by-hop anyway); parsing them would allocate a name.
            if token.is_empty()
                || token.eq_ignore_ascii_case("close")
                || token.eq_ignore_ascii_case("keep-alive")
            {
                continue;
            }
            if let Ok(name) = HeaderName::from_bytes(token.as_bytes()) {
                doomed.push(name);
            }
        }
    }
    doomed.extend(headers.keys().filter(|n| is_hop_by_hop(n)).cloned());
    for name in &doomed {
        headers.remove(name);
    }
    Ok(chunked && length)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detached_values_keep_nothing_of_the_buffer_they_were_parsed_from() {
        let mut read_buffer = bytes::BytesMut::zeroed(8192);
        read_buffer[..29].copy_from_slice(b"Tue, 01 Dec 2026 21:00:00 GMT");
        read_buffer[29..35].copy_from_slice(b"secret");
        let read_buffer = read_buffer.freeze();
        let mut headers = HeaderMap::new();
        let date = HeaderValue::from_maybe_shared(read_buffer.slice(..29)).unwrap();
        let mut secret = HeaderValue::from_maybe_shared(read_buffer.slice(29..35)).unwrap();
        secret.set_sensitive(true);
        headers.insert(header::DATE, date);
        headers.append(header::AUTHORIZATION, secret);
        headers.append(header::AUTHORIZATION, HeaderValue::from_static("second"));
        assert!(!read_buffer.is_unique(), "the values share the buffer");

        detach_values(&mut headers);

        assert!(read_buffer.is_unique(), "no value keeps the buffer alive");
        assert_eq!(headers[header::DATE], "Tue, 01 Dec 2026 21:00:00 GMT");
        let secrets: Vec<_> = headers.get_all(header::AUTHORIZATION).iter().collect();
        assert_eq!(secrets, ["secret", "second"]);
        assert!(secrets[0].is_sensitive(), "sensitivity survives");
        assert!(!secrets[1].is_sensitive());
    }

    /// Header lines, sorted (the order of distinct names carries no
    /// meaning).
    fn render(headers: &HeaderMap) -> String {
        let mut lines: Vec<String> = headers
            .iter()
            .map(|(name, value)| format!("{name}: {}\r\n", value.to_str().unwrap()))
            .collect();
        lines.sort();
        lines.concat()
    }

    /// The upstream's headers for a client's, over HTTP/1.1 without the
    /// `Host` line (the upstream's authority).
    fn request_headers(
        h: &HeaderMap,
        client: Option<&ClientAddr>,
        authority: Option<&http::uri::Authority>,
    ) -> HeaderMap {
        let mut h = h.clone();
        filter_request_headers(&mut h, client, authority, None);
        h
    }

    #[test]
    fn answers_lose_hop_by_hop_headers_and_foreign_transfer_codings_are_refused() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "x-hop".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        h.insert("x-kept", "yes".parse().unwrap());
        assert!(!strip_response_headers(&mut h).unwrap());
        assert_eq!(render(&h), "x-kept: yes\r\n");
        let mut both = HeaderMap::new();
        both.insert(header::TRANSFER_ENCODING, "chunked".parse().unwrap());
        both.insert(header::CONTENT_LENGTH, "99".parse().unwrap());
        assert!(
            strip_response_headers(&mut both).unwrap(),
            "framed two ways"
        );
        assert!(both.is_empty());
        let mut gzip = HeaderMap::new();
        gzip.insert(header::TRANSFER_ENCODING, "gzip, chunked".parse().unwrap());
        assert!(strip_response_headers(&mut gzip).is_err());
    }

    #[test]
    fn http2_cookie_crumbs_reach_an_http1_upstream_as_one_header() {
        let mut h = HeaderMap::new();
        h.append(header::COOKIE, "a=1".parse().unwrap());
        h.append(header::COOKIE, "b=2".parse().unwrap());
        filter_request_headers(&mut h, None, None, Some(HeaderValue::from_static("up:1")));
        let cookies: Vec<_> = h.get_all(header::COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1; b=2"]);
        assert_eq!(h.get(header::HOST).unwrap(), "up:1");
    }

    #[test]
    fn a_tls_client_is_forwarded_as_https() {
        let client = ClientAddr::secure("127.0.0.1:9".parse().unwrap());
        let h = request_headers(&HeaderMap::new(), Some(&client), None);
        assert_eq!(h.get(X_FORWARDED_PROTO).unwrap(), "https");
    }

    #[test]
    fn the_hop_by_hop_check_matches_the_list() {
        for name in &HOP_BY_HOP {
            assert!(is_hop_by_hop(name), "{name}");
        }
        for name in ["x-end", "content-length", "host", "keep-alivex"] {
            assert!(!is_hop_by_hop(&HeaderName::from_static(name)), "{name}");
        }
    }

    #[test]
    fn hop_by_hop_and_connection_named_headers_are_not_forwarded() {
        let mut h = HeaderMap::new();
        h.insert(header::CONNECTION, "close, X-Secret-Hop".parse().unwrap());
        h.insert("x-secret-hop", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert(header::TE, "gzip".parse().unwrap());
        h.insert(header::UPGRADE, "websocket".parse().unwrap());
        h.insert("x-end-to-end", "kept".parse().unwrap());
        assert_eq!(
            render(&request_headers(&h, None, None)),
            "x-end-to-end: kept\r\nx-forwarded-proto: http\r\n"
        );
    }

    /// gRPC needs `te: trailers` at the service: it reaches an HTTP/2
    /// upstream (alone, whatever else the client's `TE` listed), never an
    /// HTTP/1.1 one, and no other `TE` goes anywhere.
    #[test]
    fn te_trailers_reaches_an_http2_upstream_only() {
        let te = |value: &'static str, upstream_host: Option<HeaderValue>| {
            let mut h = HeaderMap::new();
            h.insert(header::TE, HeaderValue::from_static(value));
            filter_request_headers(&mut h, None, None, upstream_host);
            h.get(header::TE).cloned()
        };
        assert_eq!(te("trailers", None).unwrap(), "trailers");
        assert_eq!(te("gzip, Trailers;q=0.5", None).unwrap(), "trailers");
        assert_eq!(te("gzip", None), None);
        let host = || Some(HeaderValue::from_static("upstream:80"));
        assert_eq!(te("trailers", host()), None);
    }

    #[test]
    fn forwarded_headers_are_set_and_framing_is_left_to_the_client() {
        let mut h = HeaderMap::new();
        h.insert(X_FORWARDED_FOR, "10.0.0.1".parse().unwrap());
        h.append(X_FORWARDED_FOR, "10.0.0.2".parse().unwrap());
        h.insert(X_FORWARDED_HOST, "spoofed".parse().unwrap());
        h.insert(header::HOST, "shop.example".parse().unwrap());
        h.insert(header::CONTENT_LENGTH, "3".parse().unwrap());
        h.insert(header::EXPECT, "100-continue".parse().unwrap());
        let client = ClientAddr::new("127.0.0.1:9".parse().unwrap());
        assert_eq!(
            render(&request_headers(&h, Some(&client), None)),
            "x-forwarded-for: 10.0.0.1, 10.0.0.2, 127.0.0.1\r\n\
             x-forwarded-host: shop.example\r\nx-forwarded-proto: http\r\n"
        );
    }

    #[test]
    fn a_clients_forwarded_header_ends_with_what_the_gateway_saw() {
        let mut h = HeaderMap::new();
        h.insert(header::HOST, "shop.example:8443".parse().unwrap());
        h.insert(
            header::FORWARDED,
            "for=6.6.6.6;proto=https".parse().unwrap(),
        );
        let v4 = ClientAddr::new("10.1.2.3:9".parse().unwrap());
        let out = request_headers(&h, Some(&v4), None);
        assert_eq!(
            out[header::FORWARDED],
            "for=6.6.6.6;proto=https, for=10.1.2.3;proto=http;host=\"shop.example:8443\""
        );
        let v6 = ClientAddr::secure("[2001:db8::1]:9".parse().unwrap());
        let out = request_headers(&h, Some(&v6), None);
        assert!(
            out[header::FORWARDED]
                .to_str()
                .unwrap()
                .ends_with(", for=\"[2001:db8::1]\";proto=https;host=\"shop.example:8443\""),
            "{:?}",
            out[header::FORWARDED]
        );
        // A malformed one (an open quote) is dropped, not extended.
        h.insert(header::FORWARDED, "for=\"6.6.6.6".parse().unwrap());
        assert_eq!(
            request_headers(&h, Some(&v4), None)[header::FORWARDED],
            "for=10.1.2.3;proto=http;host=\"shop.example:8443\""
        );
        // A Host with separators is left out of the element.
        h.insert(header::FORWARDED, "for=1.1.1.1".parse().unwrap());
        h.insert(header::HOST, "a,for=6.6.6.6".parse().unwrap());
        assert_eq!(
            request_headers(&h, Some(&v4), None)[header::FORWARDED],
            "for=1.1.1.1, for=10.1.2.3;proto=http"
        );
        // A dual-stack listener's mapped IPv4 goes as IPv4.
        let mapped = ClientAddr::new("[::ffff:10.1.2.3]:9".parse().unwrap());
        assert_eq!(
            request_headers(&h, Some(&mapped), None)[X_FORWARDED_FOR],
            "10.1.2.3"
        );
        for ok in [
            "for=a",
            "for=\"[::1]\";proto=https, for=b",
            "a=b;c=\"x\\\"y\"",
        ] {
            assert!(is_forwarded(ok.as_bytes()), "{ok}");
        }
        for bad in [
            "",
            "for",
            "for=",
            "for=\"x",
            "for=a b",
            "for=a;;",
            "=a",
            "for=\"x\\",
        ] {
            assert!(!is_forwarded(bad.as_bytes()), "{bad}");
        }
        h.insert(header::HOST, "shop.example:8443".parse().unwrap());
        // `Connection: forwarded` cannot strip it: the gateway's element
        // stays last.
        h.insert(header::CONNECTION, "forwarded".parse().unwrap());
        h.insert(header::FORWARDED, "for=1.1.1.1".parse().unwrap());
        assert_eq!(
            request_headers(&h, Some(&v4), None)[header::FORWARDED],
            "for=1.1.1.1, for=10.1.2.3;proto=http;host=\"shop.example:8443\""
        );
        h.remove(header::CONNECTION);
        // None sent, none added: upstreams read X-Forwarded-*.
        h.remove(header::FORWARDED);
        assert!(
            request_headers(&h, Some(&v4), None)
                .get(header::FORWARDED)
                .is_none()
        );
    }

    #[test]
    fn connection_never_names_what_the_gateway_sets() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "Idempotency-Key, X-Request-Id, x-forwarded-for, keep-alive"
                .parse()
                .unwrap(),
        );
        h.append(
            header::CONNECTION,
            "X-Forwarded-Proto, x-forwarded-host, Forwarded, X-Secret, close"
                .parse()
                .unwrap(),
        );
        assert_eq!(
            connection_named(&h),
            vec![HeaderName::from_static("x-secret")]
        );
        for name in [
            "idempotency-key",
            "x-request-id",
            "x-forwarded-for",
            "x-forwarded-proto",
            "x-forwarded-host",
            "forwarded",
        ] {
            assert!(is_set_by_gateway(&HeaderName::from_static(name)), "{name}");
        }
        for name in ["x-secret", "idempotency-token", "x-forwarded", "connection"] {
            assert!(!is_set_by_gateway(&HeaderName::from_static(name)), "{name}");
        }
    }

    #[test]
    fn a_client_connection_header_cannot_remove_the_gateways_headers() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "idempotency-key, x-request-id, x-forwarded-for"
                .parse()
                .unwrap(),
        );
        h.append(
            header::CONNECTION,
            "x-forwarded-proto, x-forwarded-host, x-secret"
                .parse()
                .unwrap(),
        );
        // As the engine and the request id layer leave them: the stable key
        // and the request id are the gateway's values by now.
        h.insert("idempotency-key", "ig-stable".parse().unwrap());
        h.insert("x-request-id", "rid-1".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert(header::HOST, "shop.example".parse().unwrap());
        let client = ClientAddr::new("127.0.0.1:9".parse().unwrap());
        assert_eq!(
            render(&request_headers(&h, Some(&client), None)),
            "idempotency-key: ig-stable\r\nx-forwarded-for: 127.0.0.1\r\n\
             x-forwarded-host: shop.example\r\nx-forwarded-proto: http\r\n\
             x-request-id: rid-1\r\n"
        );
    }

    #[test]
    fn an_ordinary_header_named_by_connection_is_still_dropped() {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONNECTION,
            "x-request-id, X-Secret".parse().unwrap(),
        );
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("x-request-id", "rid-2".parse().unwrap());
        h.insert("x-kept", "yes".parse().unwrap());
        assert_eq!(
            render(&request_headers(&h, None, None)),
            "x-forwarded-proto: http\r\nx-kept: yes\r\nx-request-id: rid-2\r\n"
        );
    }
}
