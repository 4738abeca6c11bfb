//! HTTP/1.1 on the upstream side: request heads out, response heads in, and
//! the message framing of RFC 9112 §6.
//!
//! The gateway speaks to upstreams through this small codec instead of a
//! general-purpose client because the pass-through path is measured against
//! nginx: a request head is written with one `write`, a response
//! whose body is already in the read buffer is answered without a body
//! task, and nothing crosses a channel. Everything here is strict: a
//! response that could be framed two ways (`Transfer-Encoding` and a
//! `Content-Length`, two different lengths, a bad chunk line) is either
//! refused or read to the end of the connection, and its connection is
//! never reused, so one upstream answer can never be mistaken for two.

use std::io::Write as _;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{HeaderMap, HeaderName, HeaderValue};

use super::headers::is_hop_by_hop;
use http::{Method, StatusCode, Version};

/// The longest response head accepted (status line and headers).
pub(super) const MAX_HEAD_BYTES: usize = 64 * 1024;
/// The most response headers accepted.
const MAX_HEADERS: usize = 128;
/// Headers parsed without the full slot array.
const FEW_HEADERS: usize = 16;
/// The longest chunk-size or trailer line accepted.
const MAX_LINE_BYTES: usize = 4096;
/// The most trailer bytes accepted (trailers are read and dropped).
const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// A malformed or unacceptable upstream message.
#[derive(Debug, thiserror::Error)]
pub(super) enum WireError {
    #[error("response head over {MAX_HEAD_BYTES} bytes")]
    HeadTooLarge,
    #[error("malformed response head: {0}")]
    Head(String),
    #[error("conflicting Content-Length values")]
    ConflictingLength,
    #[error("malformed chunked body: {0}")]
    Chunk(&'static str),
}

/// How the request body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RequestFraming {
    /// No body and no framing header.
    None,
    /// `Content-Length: n`, then exactly n bytes.
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// Writes a request head: the request line, `Host` (the upstream's
/// authority), the header lines `write_headers` writes (which must leave
/// out `Host` and the framing headers), then the framing itself.
pub(super) fn encode_request_head(
    out: &mut Vec<u8>,
    method: &Method,
    path_and_query: &str,
    authority: &str,
    write_headers: impl FnOnce(&mut Vec<u8>),
    framing: RequestFraming,
) {
    out.extend_from_slice(method.as_str().as_bytes());
    out.push(b' ');
    out.extend_from_slice(path_and_query.as_bytes());
    out.extend_from_slice(b" HTTP/1.1\r\nhost: ");
    out.extend_from_slice(authority.as_bytes());
    out.extend_from_slice(b"\r\n");
    write_headers(out);
    match framing {
        RequestFraming::None => {}
        RequestFraming::Length(n) => {
            let _ = write!(out, "content-length: {n}\r\n");
        }
        RequestFraming::Chunked => out.extend_from_slice(b"transfer-encoding: chunked\r\n"),
    }
    out.extend_from_slice(b"\r\n");
}

/// Appends one chunk of a chunked body.
pub(super) fn encode_chunk(out: &mut Vec<u8>, data: &[u8]) {
    if data.is_empty() {
        return; // an empty chunk would end the body
    }
    let _ = write!(out, "{:x}\r\n", data.len());
    out.extend_from_slice(data);
    out.extend_from_slice(b"\r\n");
}

/// The last chunk and an empty trailer section.
pub(super) const LAST_CHUNK: &[u8] = b"0\r\n\r\n";

/// How the response body is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum BodyFraming {
    /// No body (HEAD, 1xx, 204, 304).
    Empty,
    /// Exactly this many bytes.
    Length(u64),
    /// Chunked transfer coding.
    Chunked,
    /// Everything until the upstream closes the connection.
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub(super) struct ResponseHead {
    pub(super) status: StatusCode,
    pub(super) headers: HeaderMap,
    pub(super) framing: BodyFraming,
    /// Whether the connection may carry another request after this
    /// response's body has been read to its end.
    pub(super) reusable: bool,
}

/// Parses a response head from the front of `buf`. `Ok(None)` means more
/// bytes are needed. Interim 1xx responses (other than 101) are consumed
/// and skipped. On success the head's bytes are removed from `buf`.
pub(super) fn parse_response_head(
    buf: &mut BytesMut,
    method: &Method,
) -> Result<Option<ResponseHead>, WireError> {
    loop {
        // Most answers have a handful of headers: parse into a small slot
        // array first (filling slots costs per slot), the full one only
        // when that overflows.
        let mut few = [httparse::EMPTY_HEADER; FEW_HEADERS];
        let mut many;
        let mut response = httparse::Response::new(&mut few);
        let mut parsed = response.parse(buf);
        if matches!(parsed, Err(httparse::Error::TooManyHeaders)) {
            many = [httparse::EMPTY_HEADER; MAX_HEADERS];
            response = httparse::Response::new(&mut many);
            parsed = response.parse(buf);
        }
        let len = match parsed {
            Ok(httparse::Status::Complete(len)) => len,
            Ok(httparse::Status::Partial) if buf.len() >= MAX_HEAD_BYTES => {
                return Err(WireError::HeadTooLarge);
            }
            Ok(httparse::Status::Partial) => return Ok(None),
            Err(e) => return Err(WireError::Head(e.to_string())),
        };
        let code = response.code.unwrap_or(0);
        let status =
            StatusCode::from_u16(code).map_err(|_| WireError::Head(format!("status {code}")))?;
        let version = if response.version == Some(0) {
            Version::HTTP_10
        } else {
            Version::HTTP_11
        };
        if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
            // 100 Continue and 103 Early Hints precede the real answer.
            buf.advance(len);
            continue;
        }
        let facts = HeadFacts::gather(response.headers)?;
        let (framing, framing_safe) = facts.framing(status, method);
        let reusable = framing_safe
            && framing != BodyFraming::UntilClose
            && status != StatusCode::SWITCHING_PROTOCOLS
            && !facts.close
            && (version == Version::HTTP_11 || facts.keep_alive);
        // A Content-Length beside Transfer-Encoding does not describe the
        // body we relay (and one on a body read until close is not
        // trusted): the relayed answer gets its length from the body.
        let drop_length = matches!(framing, BodyFraming::Chunked | BodyFraming::UntilClose);
        // Values are slices of the head's own bytes, not copies: the head
        // is split off the buffer once and every value shares it. The
        // hop-by-hop headers (and those `Connection` names) never enter the
        // map: the answer leaves this codec ready to forward.
        let mut kept: Vec<(HeaderName, usize, usize)> = Vec::with_capacity(response.headers.len());
        for h in response.headers.iter() {
            let name = HeaderName::from_bytes(h.name.as_bytes())
                .map_err(|_| WireError::Head(format!("header name {:?}", h.name)))?;
            if is_hop_by_hop(&name)
                || facts.names_hop(&name)
                || (drop_length && name == http::header::CONTENT_LENGTH)
            {
                continue;
            }
            let start = h.value.as_ptr() as usize - buf.as_ptr() as usize;
            kept.push((name, start, start + h.value.len()));
        }
        let head = buf.split_to(len).freeze();
        let mut headers = HeaderMap::with_capacity(kept.len());
        for (name, start, end) in kept {
            let value = HeaderValue::from_maybe_shared(head.slice(start..end))
                .map_err(|_| WireError::Head(format!("value of {name}")))?;
            headers.append(name, value);
        }
        return Ok(Some(ResponseHead {
            status,
            headers,
            framing,
            reusable,
        }));
    }
}

/// What the framing and connection headers of a response say, read from
/// the raw head in one pass (no header-map lookups).
#[derive(Debug, Default)]
struct HeadFacts<'h> {
    /// Whether `Transfer-Encoding` is present, and whether its final
    /// coding is `chunked`.
    transfer_encoding: bool,
    chunked_last: bool,
    /// The one `Content-Length` (several equal values are one).
    content_length: Option<u64>,
    close: bool,
    keep_alive: bool,
    /// Other names `Connection` lists.
    named: Vec<&'h str>,
}

impl<'h> HeadFacts<'h> {
    fn gather(raw: &[httparse::Header<'h>]) -> Result<Self, WireError> {
        let mut facts = HeadFacts::default();
        for h in raw {
            let values = || {
                std::str::from_utf8(h.value)
                    .unwrap_or("\u{0}")
                    .split(',')
                    .map(str::trim)
            };
            if h.name.eq_ignore_ascii_case("transfer-encoding") {
                facts.transfer_encoding = true;
                if let Some(last) = values().rfind(|t| !t.is_empty()) {
                    facts.chunked_last = last.eq_ignore_ascii_case("chunked");
                }
            } else if h.name.eq_ignore_ascii_case("content-length") {
                for part in values() {
                    if part.is_empty() || !part.bytes().all(|b| b.is_ascii_digit()) {
                        return Err(WireError::ConflictingLength);
                    }
                    let n: u64 = part.parse().map_err(|_| WireError::ConflictingLength)?;
                    if facts.content_length.is_some_and(|prior| prior != n) {
                        return Err(WireError::ConflictingLength);
                    }
                    facts.content_length = Some(n);
                }
            } else if h.name.eq_ignore_ascii_case("connection") {
                for token in values() {
                    if token.eq_ignore_ascii_case("close") {
                        facts.close = true;
                    } else if token.eq_ignore_ascii_case("keep-alive") {
                        facts.keep_alive = true;
                    } else if !token.is_empty() {
                        facts.named.push(token);
                    }
                }
            }
        }
        Ok(facts)
    }

    /// Whether `Connection` names this header.
    fn names_hop(&self, name: &HeaderName) -> bool {
        self.named
            .iter()
            .any(|token| token.eq_ignore_ascii_case(name.as_str()))
    }

    /// RFC 9112 §6.3, in its order. The second value is false when the
    /// message was framed ambiguously (the connection must then not be
    /// reused).
    fn framing(&self, status: StatusCode, method: &Method) -> (BodyFraming, bool) {
        if method == Method::HEAD
            || status.is_informational()
            || status == StatusCode::NO_CONTENT
            || status == StatusCode::NOT_MODIFIED
        {
            return (BodyFraming::Empty, true);
        }
        if self.transfer_encoding {
            // Chunked only when it is the final coding; anything else is
            // read until close. With a Content-Length too,
            // Transfer-Encoding wins and the connection is not reused
            // (§6.3 item 3).
            let framing = if self.chunked_last {
                BodyFraming::Chunked
            } else {
                BodyFraming::UntilClose
            };
            return (framing, self.content_length.is_none());
        }
        match self.content_length {
            Some(n) => (BodyFraming::Length(n), true),
            None => (BodyFraming::UntilClose, true),
        }
    }
}

/// Decodes a chunked body incrementally from a read buffer.
#[derive(Debug, Default)]
pub(super) struct ChunkedDecoder {
    state: ChunkState,
    trailer_bytes: usize,
}

#[derive(Debug, Default, Clone, Copy)]
enum ChunkState {
    #[default]
    Size,
    Data(u64),
    DataEnd,
    Trailers,
    Done,
}

/// One step of decoding.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Decoded {
    /// Body bytes.
    Data(Bytes),
    /// The buffer holds no complete next piece: read more.
    NeedMore,
    /// The last chunk and the trailers have been read.
    Done,
}

impl ChunkedDecoder {
    /// Takes the next piece of the body out of `buf`.
    pub(super) fn decode(&mut self, buf: &mut BytesMut) -> Result<Decoded, WireError> {
        loop {
            match self.state {
                ChunkState::Done => return Ok(Decoded::Done),
                ChunkState::Size => {
                    let Some(line) = take_line(buf)? else {
                        return Ok(Decoded::NeedMore);
                    };
                    let size = parse_chunk_size(&line)?;
                    self.state = if size == 0 {
                        ChunkState::Trailers
                    } else {
                        ChunkState::Data(size)
                    };
                }
                ChunkState::Data(remaining) => {
                    if buf.is_empty() {
                        return Ok(Decoded::NeedMore);
                    }
                    let n = remaining.min(buf.len() as u64) as usize;
                    let data = buf.split_to(n).freeze();
                    let left = remaining - n as u64;
                    self.state = if left == 0 {
                        ChunkState::DataEnd
                    } else {
                        ChunkState::Data(left)
                    };
                    return Ok(Decoded::Data(data));
                }
                ChunkState::DataEnd => {
                    if buf.len() < 2 {
                        return Ok(Decoded::NeedMore);
                    }
                    if &buf[..2] != b"\r\n" {
                        return Err(WireError::Chunk("chunk data not followed by CRLF"));
                    }
                    buf.advance(2);
                    self.state = ChunkState::Size;
                }
                ChunkState::Trailers => {
                    let Some(line) = take_line(buf)? else {
                        return Ok(Decoded::NeedMore);
                    };
                    if line.is_empty() {
                        self.state = ChunkState::Done;
                    } else {
                        // Trailers are read and dropped.
                        self.trailer_bytes += line.len() + 2;
                        if self.trailer_bytes > MAX_TRAILER_BYTES {
                            return Err(WireError::Chunk("trailers too large"));
                        }
                    }
                }
            }
        }
    }
}

/// Removes one CRLF-terminated line from `buf` (without the CRLF).
fn take_line(buf: &mut BytesMut) -> Result<Option<BytesMut>, WireError> {
    let window = &buf[..buf.len().min(MAX_LINE_BYTES + 2)];
    match window.windows(2).position(|w| w == b"\r\n") {
        Some(at) => {
            let line = buf.split_to(at);
            buf.advance(2);
            Ok(Some(line))
        }
        None if buf.len() > MAX_LINE_BYTES => Err(WireError::Chunk("line too long")),
        None => Ok(None),
    }
}

fn parse_chunk_size(line: &[u8]) -> Result<u64, WireError> {
    // Chunk extensions (`;name=value`) are allowed and ignored.
    let digits = line.split(|b| *b == b';').next().unwrap_or_default();
    let digits = digits.trim_ascii();
    if digits.is_empty() || digits.len() > 15 {
        return Err(WireError::Chunk("bad chunk size"));
    }
    let mut size: u64 = 0;
    for b in digits {
        let digit = (*b as char)
            .to_digit(16)
            .ok_or(WireError::Chunk("bad chunk size"))?;
        size = size * 16 + u64::from(digit);
    }
    Ok(size)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(raw: &str, method: Method) -> Result<Option<ResponseHead>, WireError> {
        parse_response_head(&mut BytesMut::from(raw), &method)
    }

    #[test]
    fn request_head_is_one_block_with_host_and_framing() {
        let mut out = Vec::new();
        encode_request_head(
            &mut out,
            &Method::POST,
            "/o?x=1",
            "up:80",
            |out| out.extend_from_slice(b"x-a: 1\r\n"),
            RequestFraming::Length(3),
        );
        assert_eq!(
            out,
            b"POST /o?x=1 HTTP/1.1\r\nhost: up:80\r\nx-a: 1\r\ncontent-length: 3\r\n\r\n"
        );
        let mut chunked = Vec::new();
        encode_chunk(&mut chunked, b"hello");
        encode_chunk(&mut chunked, b"");
        chunked.extend_from_slice(LAST_CHUNK);
        assert_eq!(chunked, b"5\r\nhello\r\n0\r\n\r\n");
    }

    #[test]
    fn response_framing_follows_rfc_9112() {
        let head = parse(
            "HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.framing, BodyFraming::Length(5));
        assert!(head.reusable);
        let head = parse("HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\n", Method::HEAD)
            .unwrap()
            .unwrap();
        assert_eq!(head.framing, BodyFraming::Empty);
        let head = parse(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: gzip, chunked\r\n\r\n",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.framing, BodyFraming::Chunked);
        assert!(head.reusable);
        // Both framings: chunked wins and the connection is not reused.
        let head = parse(
            "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\ncontent-length: 9\r\n\r\n",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.framing, BodyFraming::Chunked);
        assert!(!head.reusable);
        assert!(
            head.headers.get("content-length").is_none(),
            "not the relayed length"
        );
        let head = parse("HTTP/1.1 200 OK\r\n\r\n", Method::GET)
            .unwrap()
            .unwrap();
        assert_eq!(head.framing, BodyFraming::UntilClose);
        assert!(!head.reusable);
        let head = parse("HTTP/1.0 200 OK\r\ncontent-length: 0\r\n\r\n", Method::GET)
            .unwrap()
            .unwrap();
        assert!(!head.reusable, "HTTP/1.0 without keep-alive");
        let head = parse(
            "HTTP/1.1 201 Created\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
            Method::POST,
        )
        .unwrap()
        .unwrap();
        assert!(!head.reusable);
        assert!(matches!(
            parse(
                "HTTP/1.1 200 OK\r\ncontent-length: 5\r\ncontent-length: 6\r\n\r\n",
                Method::GET
            ),
            Err(WireError::ConflictingLength)
        ));
        assert!(matches!(
            parse("HTTP/1.1 200 OK\r\ncontent-length: +5\r\n\r\n", Method::GET),
            Err(WireError::ConflictingLength)
        ));
        assert!(
            parse("HTTP/1.1 200 OK\r\ncontent-le", Method::GET)
                .unwrap()
                .is_none()
        );
    }

    #[test]
    fn hop_by_hop_headers_never_leave_the_codec() {
        let head = parse(
            "HTTP/1.1 200 OK\r\nConnection: keep-alive, X-Hop\r\nX-Hop: 1\r\nKeep-Alive: timeout=5\r\n\
             Transfer-Encoding: chunked\r\nX-End: 2\r\n\r\n",
            Method::GET,
        )
        .unwrap()
        .unwrap();
        assert_eq!(head.framing, BodyFraming::Chunked);
        assert_eq!(head.headers.len(), 1, "{:?}", head.headers);
        assert_eq!(head.headers["x-end"], "2");
        // More headers than the small slot array holds.
        let mut raw = String::from("HTTP/1.1 204 No Content\r\n");
        for i in 0..40 {
            raw.push_str(&format!("x-h{i}: {i}\r\n"));
        }
        raw.push_str("\r\n");
        let head = parse(&raw, Method::GET).unwrap().unwrap();
        assert_eq!(head.headers.len(), 40);
        assert_eq!(head.headers["x-h39"], "39");
    }

    #[test]
    fn interim_responses_are_skipped() {
        let mut buf =
            BytesMut::from("HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\nrest");
        let head = parse_response_head(&mut buf, &Method::POST)
            .unwrap()
            .unwrap();
        assert_eq!(head.status, StatusCode::NO_CONTENT);
        assert_eq!(&buf[..], b"rest");
    }

    #[test]
    fn chunked_bodies_decode_across_reads() {
        let wire = b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nx-trailer: t\r\n\r\nNEXT";
        for split in 0..wire.len() {
            let mut decoder = ChunkedDecoder::default();
            let mut buf = BytesMut::from(&wire[..split]);
            let mut body = Vec::new();
            let mut fed = false;
            loop {
                match decoder.decode(&mut buf).unwrap() {
                    Decoded::Data(d) => body.extend_from_slice(&d),
                    Decoded::NeedMore => {
                        assert!(!fed, "stuck at split {split}");
                        buf.extend_from_slice(&wire[split..]);
                        fed = true;
                    }
                    Decoded::Done => break,
                }
            }
            if !fed {
                buf.extend_from_slice(&wire[split..]);
            }
            assert_eq!(body, b"hello world");
            assert_eq!(&buf[..], b"NEXT");
        }
    }

    #[test]
    fn bad_chunks_are_refused() {
        for wire in [&b"zz\r\n"[..], b"1234567890abcdef0\r\n", b"\r\n"] {
            let mut buf = BytesMut::from(wire);
            assert!(
                ChunkedDecoder::default().decode(&mut buf).is_err(),
                "{wire:?}"
            );
        }
        // Chunk data must be followed by CRLF.
        let mut decoder = ChunkedDecoder::default();
        let mut buf = BytesMut::from(&b"5\r\nhelloXX"[..]);
        assert!(matches!(decoder.decode(&mut buf), Ok(Decoded::Data(_))));
        assert!(decoder.decode(&mut buf).is_err());
    }
}
