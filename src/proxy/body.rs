//! [`UpstreamBody`]: a response body still arriving from the upstream.
//!
//! Most answers arrive whole with their head and never need this (the
//! client hands them on as one buffer). A body that does not fit in the
//! first read streams through here frame by frame, straight from the
//! upstream socket, and the connection goes back to its pool the moment the
//! last byte is read. A body dropped before its end takes the connection
//! with it: the rest of that answer is still on the wire, so the socket is
//! closed rather than reused.

use std::collections::VecDeque;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

use super::pool::{Conn, Pool};
use super::wire::{ChunkedDecoder, Decoded, WireError};

/// Bytes asked of each read; a read never asks for less than half of it.
const READ_CHUNK_BYTES: usize = 16 * 1024;

/// How much of the body is left.
#[derive(Debug)]
pub(super) enum Remaining {
    Length(u64),
    Chunked(ChunkedDecoder),
    UntilClose,
}

/// Why a streamed body stopped.
#[derive(Debug, thiserror::Error)]
pub(super) enum BodyError {
    #[error("upstream closed the connection in the middle of the body")]
    Truncated,
    #[error("reading the upstream body failed: {0}")]
    Io(#[from] std::io::Error),
    #[error(transparent)]
    Wire(#[from] WireError),
}

/// A response body read from an upstream connection as it arrives.
#[derive(Debug)]
pub(super) struct UpstreamBody {
    conn: Option<Conn>,
    pool: Arc<Pool>,
    remaining: Remaining,
    /// Data already decoded before the body was handed on.
    decoded: VecDeque<Bytes>,
    reusable: bool,
}

impl UpstreamBody {
    /// Streams the rest of a body from `conn`, whose read buffer holds the
    /// bytes read so far after the head.
    pub(super) fn new(
        conn: Conn,
        pool: Arc<Pool>,
        remaining: Remaining,
        decoded: VecDeque<Bytes>,
        reusable: bool,
    ) -> Self {
        UpstreamBody {
            conn: Some(conn),
            pool,
            remaining,
            decoded,
            reusable,
        }
    }

    /// The body is complete: the connection may carry the next request.
    fn finish(&mut self) {
        if let Some(conn) = self.conn.take()
            && self.reusable
        {
            self.pool.checkin(conn);
        }
    }

    fn poll_data(&mut self, cx: &mut Context<'_>) -> Poll<Option<Result<Bytes, BodyError>>> {
        loop {
            if let Some(data) = self.decoded.pop_front() {
                return Poll::Ready(Some(Ok(data)));
            }
            let Some(conn) = self.conn.as_mut() else {
                return Poll::Ready(None);
            };
            let buf = &mut conn.read_buf;
            match &mut self.remaining {
                Remaining::Length(0) => {
                    self.finish();
                    return Poll::Ready(None);
                }
                Remaining::Length(left) => {
                    if !buf.is_empty() {
                        let n = (*left).min(buf.len() as u64) as usize;
                        *left -= n as u64;
                        let data = buf.split_to(n).freeze();
                        if *left == 0 {
                            self.finish();
                        }
                        return Poll::Ready(Some(Ok(data)));
                    }
                }
                Remaining::Chunked(decoder) => match decoder.decode(buf)? {
                    Decoded::Data(data) => return Poll::Ready(Some(Ok(data))),
                    Decoded::Done => {
                        self.finish();
                        return Poll::Ready(None);
                    }
                    Decoded::NeedMore => {}
                },
                Remaining::UntilClose => {
                    if !buf.is_empty() {
                        return Poll::Ready(Some(Ok(buf.split().freeze())));
                    }
                }
            }
            // The buffer is used up: read more from the upstream.
            if buf.capacity() - buf.len() < READ_CHUNK_BYTES / 2 {
                buf.reserve(READ_CHUNK_BYTES);
            }
            let read = ready!(tokio_util::io::poll_read_buf(
                Pin::new(&mut conn.stream),
                cx,
                buf
            ));
            match read {
                Ok(0) => {
                    self.conn = None;
                    return Poll::Ready(match self.remaining {
                        Remaining::UntilClose => None,
                        _ => Some(Err(BodyError::Truncated)),
                    });
                }
                Ok(_) => continue,
                Err(e) => {
                    self.conn = None;
                    return Poll::Ready(Some(Err(e.into())));
                }
            }
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        let polled = this.poll_data(cx);
        if let Poll::Ready(Some(Err(_))) = &polled {
            // Whatever is left on that socket cannot be trusted.
            this.conn = None;
        }
        polled.map(|data| data.map(|data| data.map(Frame::data)))
    }

    fn is_end_stream(&self) -> bool {
        self.decoded.is_empty()
            && (self.conn.is_none() || matches!(self.remaining, Remaining::Length(0)))
    }

    fn size_hint(&self) -> SizeHint {
        let buffered: u64 = self.decoded.iter().map(|d| d.len() as u64).sum();
        match self.remaining {
            Remaining::Length(left) => SizeHint::with_exact(buffered + left),
            _ => {
                let mut hint = SizeHint::new();
                hint.set_lower(buffered);
                hint
            }
        }
    }
}
