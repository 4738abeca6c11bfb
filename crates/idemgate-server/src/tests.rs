//! The accept loop's fairness, on one event loop as a worker runs it.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::body::Body;
use http::Response;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{ConnLimits, serve, shutdown_pair};

/// A burst of connections that are all ready at once is accepted one per
/// scheduler turn: work already on the event loop (here a task that counts
/// its turns, standing for the requests of connections already open) gets
/// a turn between any two of them, instead of waiting behind the whole
/// burst.
#[tokio::test]
async fn a_burst_of_new_connections_is_accepted_one_per_turn() {
    const BURST: usize = 60;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    // Every connection of the burst is in the backlog, its request sent,
    // before the loop starts.
    let mut clients = Vec::new();
    for _ in 0..BURST {
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        clients.push(client);
    }
    let turns = Arc::new(AtomicUsize::new(0));
    let counter = turns.clone();
    let ticker = tokio::spawn(async move {
        loop {
            counter.fetch_add(1, Ordering::Relaxed);
            tokio::task::yield_now().await;
        }
    });
    // Each request notes the turn it was served in.
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let (stop, signal) = shutdown_pair();
    let (turns_at, seen_by) = (turns.clone(), seen.clone());
    let server = tokio::spawn(serve(
        listener,
        move |_, _, _| {
            let (turns, seen) = (turns_at.clone(), seen_by.clone());
            hyper::service::service_fn(move |_| {
                seen.lock().unwrap().push(turns.load(Ordering::Relaxed));
                async { Ok::<_, std::convert::Infallible>(Response::new(Body::empty())) }
            })
        },
        ConnLimits::plain(Duration::from_secs(5), 1024, Duration::from_secs(1)),
        None,
        signal,
    ));
    for mut client in clients {
        let mut answer = Vec::new();
        client.read_to_end(&mut answer).await.unwrap();
        assert!(answer.starts_with(b"HTTP/1.1 200"), "{answer:?}");
    }
    stop.trigger();
    let _ = server.await;
    ticker.abort();
    let mut seen = seen.lock().unwrap().clone();
    seen.sort_unstable();
    seen.dedup();
    // Accepted a coop budget at a time, the burst is served in one or two
    // turns.
    assert!(
        seen.len() >= BURST * 9 / 10,
        "{BURST} connections were served in only {} distinct turns",
        seen.len()
    );
}
