//! Keep-alive connections to one upstream, owned by one worker thread.
//!
//! Every worker thread builds its own routes, so every worker has its own
//! pool per upstream: a connection is only ever driven by the thread that
//! opened it, and checkout and checkin are an uncontended lock around a
//! `Vec`. Idle connections are not polled by anyone; a connection the
//! upstream closed while it sat idle is noticed at checkout, where a
//! non-blocking read sees its end-of-stream (tokio answers that read from
//! the readiness the reactor already recorded, so a live connection costs
//! no system call).

use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::BytesMut;
use tokio::net::TcpStream;

/// Idle connections are closed after this, well below the keep-alive
/// timeouts of common servers (nginx 75 s; Node's 5 s is the exception), so
/// a request rarely meets a connection the upstream is closing.
pub(super) const POOL_IDLE_TIMEOUT: Duration = Duration::from_secs(4);
/// Idle connections kept per upstream per worker; more are closed.
pub(super) const POOL_MAX_IDLE: usize = 1024;
/// How long opening a connection may take (every resolved address).
pub(super) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// Read buffer capacity of a new connection.
const READ_BUFFER_BYTES: usize = 8 * 1024;

/// One upstream connection and what was read from it but not yet used.
#[derive(Debug)]
pub(super) struct Conn {
    pub(super) stream: TcpStream,
    pub(super) read_buf: BytesMut,
    /// Whether it carried an earlier request (a fresh one cannot be stale).
    pub(super) reused: bool,
}

#[derive(Debug)]
struct Idle {
    conn: Conn,
    since: Instant,
}

/// The idle connections to one upstream.
#[derive(Debug)]
pub struct Pool {
    authority: String,
    idle: Mutex<Vec<Idle>>,
    connect_timeout: Duration,
}

impl Pool {
    /// An empty pool for `authority` (`host:port`). When called inside a
    /// tokio runtime, a reaper task closes idle connections past
    /// [`POOL_IDLE_TIMEOUT`]; it ends when the pool is dropped.
    pub fn new(authority: String) -> Arc<Pool> {
        Self::with_connect_timeout(authority, CONNECT_TIMEOUT)
    }

    /// A pool whose connects give up after `connect_timeout` (at most
    /// [`CONNECT_TIMEOUT`]). A route's upstream timeout bounds the whole
    /// exchange; the connect must fail before it does, so that a request
    /// that never left is reported as never sent (its claim released), not
    /// as an uncertain timeout.
    pub fn with_connect_timeout(authority: String, connect_timeout: Duration) -> Arc<Pool> {
        let pool = Arc::new(Pool {
            authority,
            idle: Mutex::new(Vec::new()),
            connect_timeout: connect_timeout.min(CONNECT_TIMEOUT),
        });
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            runtime.spawn(reap(Arc::downgrade(&pool)));
        }
        pool
    }

    /// The `host:port` this pool connects to.
    pub(super) fn authority(&self) -> &str {
        &self.authority
    }

    /// The most recently used live idle connection, if any. Last in, first
    /// out: the warmest connection is the least likely to be closing.
    pub(super) fn checkout(&self) -> Option<Conn> {
        loop {
            let idle = self.lock().pop()?;
            if idle.since.elapsed() >= POOL_IDLE_TIMEOUT {
                // Everything below it is older still.
                self.lock().clear();
                return None;
            }
            let mut probe = [0u8; 1];
            match idle.conn.stream.try_read(&mut probe) {
                // Nothing to read: the connection is open and quiet.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Some(idle.conn),
                // End of stream, stray bytes or an error: not reusable.
                _ => continue,
            }
        }
    }

    /// Returns a connection whose last exchange ended cleanly.
    pub(super) fn checkin(&self, mut conn: Conn) {
        if !conn.read_buf.is_empty() {
            return; // bytes after the response: the framing is off, close
        }
        conn.reused = true;
        let mut idle = self.lock();
        if idle.len() < POOL_MAX_IDLE {
            idle.push(Idle {
                conn,
                since: Instant::now(),
            });
        }
    }

    /// Opens a new connection, trying each resolved address in turn.
    pub(super) async fn connect(&self) -> io::Result<Conn> {
        let attempt = async {
            let mut last = io::Error::new(io::ErrorKind::NotFound, "no address resolved");
            for addr in tokio::net::lookup_host(self.authority.as_str()).await? {
                match connect_one(addr).await {
                    Ok(stream) => return Ok(stream),
                    Err(e) => last = e,
                }
            }
            Err(last)
        };
        let stream = tokio::time::timeout(self.connect_timeout, attempt)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        Ok(Conn {
            stream,
            read_buf: BytesMut::with_capacity(READ_BUFFER_BYTES),
            reused: false,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Idle>> {
        // Nothing panics while holding the lock (push, pop, retain), so a
        // poisoned lock still guards a consistent Vec.
        self.idle.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn close_expired(&self) {
        let now = Instant::now();
        self.lock()
            .retain(|idle| now.duration_since(idle.since) < POOL_IDLE_TIMEOUT);
    }

    /// How many idle connections the pool holds (for tests).
    #[cfg(test)]
    pub(super) fn idle_count(&self) -> usize {
        self.lock().len()
    }
}

async fn connect_one(addr: SocketAddr) -> io::Result<TcpStream> {
    let stream = TcpStream::connect(addr).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

async fn reap(pool: Weak<Pool>) {
    let mut tick = tokio::time::interval(POOL_IDLE_TIMEOUT / 2);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match pool.upgrade() {
            Some(pool) => pool.close_expired(),
            None => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::TcpListener;

    #[tokio::test]
    async fn a_connection_closed_while_idle_is_not_handed_out() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(listener.local_addr().unwrap().to_string());
        let conn = pool.connect().await.unwrap();
        let (mut server_side, _) = listener.accept().await.unwrap();
        pool.checkin(conn);
        assert_eq!(pool.idle_count(), 1);
        let live = pool.checkout().expect("a live idle connection is reused");
        assert!(live.reused);
        pool.checkin(live);
        server_side.shutdown().await.unwrap();
        drop(server_side);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(
            pool.checkout().is_none(),
            "the closed connection is dropped"
        );
        assert_eq!(pool.idle_count(), 0);
    }

    #[tokio::test]
    async fn leftover_bytes_keep_a_connection_out_of_the_pool() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let pool = Pool::new(listener.local_addr().unwrap().to_string());
        let mut conn = pool.connect().await.unwrap();
        conn.read_buf.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
        pool.checkin(conn);
        assert_eq!(pool.idle_count(), 0);
    }
}
