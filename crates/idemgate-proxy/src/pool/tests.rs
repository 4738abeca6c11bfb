//! The pool on its own against small local upstreams: idle checks, the
//! HTTP/2 stream count and shared opens.

use super::*;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpListener;

#[tokio::test]
async fn a_connection_closed_while_idle_is_not_handed_out() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let pool = Pool::new(listener.local_addr().unwrap().to_string());
    let Sender::Http1(sender) = pool.connect().await.unwrap().sender else {
        panic!("an HTTP/1.1 pool");
    };
    let (mut server_side, _) = listener.accept().await.unwrap();
    let mut sender = sender;
    sender.ready().await.unwrap();
    pool.checkin(sender);
    assert_eq!(pool.idle_count(), 1);
    let live = pool.checkout().await.expect("a live idle connection");
    assert!(live.reused, "the idle connection is reused");
    let Sender::Http1(sender) = live.sender else {
        panic!("an HTTP/1.1 pool");
    };
    pool.checkin(sender);
    server_side.shutdown().await.unwrap();
    drop(server_side);
    // hyper's dispatcher reads the idle connection and sees its end.
    for _ in 0..100 {
        match pool.checkout_idle() {
            None => break,
            Some(Found(Sender::Http1(sender), _)) => pool.checkin(sender),
            Some(Found(Sender::Http2(_), _)) => panic!("an HTTP/1.1 pool"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(pool.idle_count(), 0, "the closed connection is dropped");
}

#[tokio::test]
async fn a_full_h2_connection_gets_a_sibling_that_is_let_go_when_idle() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(async move {
                // Only the handshake: no request is sent in this test.
                if let Ok(mut connection) = h2::server::handshake(tcp).await {
                    while connection.accept().await.is_some() {}
                }
            });
        }
    });
    let options = PoolOptions {
        http2: true,
        ..PoolOptions::default()
    };
    let pool = Pool::with_options(addr.to_string(), options);
    let mut slots = Vec::new();
    for _ in 0..=H2_STREAMS_PER_CONNECTION {
        slots.push(pool.checkout().await.unwrap().stream.unwrap());
    }
    assert_eq!(
        lock(&pool.shared_h2).len(),
        2,
        "the 101st stream opened a second"
    );
    // Both carry streams: the reaper keeps both.
    pool.close_expired();
    assert_eq!(lock(&pool.shared_h2).len(), 2);
    let first = lock(&pool.shared_h2)[0].streams.clone();
    assert_eq!(first.load(Ordering::Acquire), H2_STREAMS_PER_CONNECTION);
    slots.clear();
    assert_eq!(
        first.load(Ordering::Acquire),
        0,
        "dropped slots are uncounted"
    );
    pool.close_expired();
    assert_eq!(
        lock(&pool.shared_h2).len(),
        2,
        "one quiet tick is not idle yet"
    );
    pool.close_expired();
    assert_eq!(lock(&pool.shared_h2).len(), 1, "the idle sibling is let go");
    let again = pool.checkout().await.unwrap();
    assert!(again.reused, "the first connection is still shared");
}

#[tokio::test]
async fn a_burst_on_a_cold_h2_pool_opens_one_connection_per_hundred_streams() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::AcqRel);
            tokio::spawn(async move {
                if let Ok(mut connection) = h2::server::handshake(tcp).await {
                    while connection.accept().await.is_some() {}
                }
            });
        }
    });
    let options = PoolOptions {
        http2: true,
        ..PoolOptions::default()
    };
    let pool = Pool::with_options(addr.to_string(), options);
    let checkouts = (0..250).map(|_| pool.checkout());
    let checked = futures_util::future::join_all(checkouts).await;
    let slots: Vec<StreamSlot> = checked
        .into_iter()
        .map(|c| c.unwrap().stream.unwrap())
        .collect();
    assert_eq!(slots.len(), 250);
    let mut carried: Vec<usize> = lock(&pool.shared_h2)
        .iter()
        .map(|h2| h2.streams.load(Ordering::Acquire))
        .collect();
    carried.sort_unstable();
    assert_eq!(carried, [50, 100, 100], "three connections, filled in turn");
    // (The upstream's accept loop may run after the handshakes.)
    for _ in 0..100 {
        if accepted.load(Ordering::Acquire) >= 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(
        accepted.load(Ordering::Acquire),
        3,
        "250 requests at once on a cold pool: three connections"
    );
}

#[tokio::test]
async fn waiters_on_an_h2_open_that_fails_all_fail_as_never_sent_and_the_next_tries_again() {
    // A port nothing listens on: the connect is refused.
    let addr = TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap()
        .local_addr()
        .unwrap();
    let options = PoolOptions {
        http2: true,
        ..PoolOptions::default()
    };
    let pool = Pool::with_options(addr.to_string(), options);
    let checkouts = (0..20).map(|_| pool.checkout());
    for result in futures_util::future::join_all(checkouts).await {
        assert!(matches!(result, Err(ConnectError::Io(_))));
    }
    assert!(lock(&pool.opening_h2).is_none(), "no stale open is kept");
    let listener = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        let (tcp, _) = listener.accept().await.unwrap();
        if let Ok(mut connection) = h2::server::handshake(tcp).await {
            while connection.accept().await.is_some() {}
        }
    });
    assert!(pool.checkout().await.is_ok(), "the next request opens anew");
}

#[tokio::test(start_paused = true)]
async fn waiters_on_a_slow_h2_open_wait_for_that_one_open_only() {
    // An upstream that takes the TCP connection and never answers the
    // TLS handshake: the open ends at the connect timeout.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((tcp, _)) = listener.accept().await {
            counted.fetch_add(1, Ordering::AcqRel);
            held.push(tcp);
        }
    });
    let files = crate::tls::ClientFiles {
        ca_file: None,
        client_cert: None,
        client_key: None,
    };
    let config = crate::tls::client_config(&files, true).unwrap();
    let name = ServerName::try_from("localhost").unwrap();
    let timeout = Duration::from_millis(300);
    let options = PoolOptions {
        tls: Some((config, name)),
        http2: true,
        connect_timeout: Some(timeout),
        max_connections: None,
    };
    let pool = Pool::with_options(addr.to_string(), options);
    let started = tokio::time::Instant::now();
    let checkouts = (0..150).map(|_| pool.checkout());
    for result in futures_util::future::join_all(checkouts).await {
        match result {
            Err(ConnectError::Io(e)) => assert_eq!(e.kind(), std::io::ErrorKind::TimedOut),
            Err(e) => panic!("a connect timeout, not {e}"),
            Ok(_) => panic!("the upstream never answers"),
        }
    }
    assert!(
        started.elapsed() < timeout * 2,
        "each waited for one open: {:?}",
        started.elapsed()
    );
    assert_eq!(
        accepted.load(Ordering::Acquire),
        2,
        "two opens for 150 requests"
    );
}
