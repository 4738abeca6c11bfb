//! The public listener's worker threads: each its own event loop, its own
//! handle of the one listening socket, its own store connections and route
//! stacks.

use std::net::SocketAddr;
use std::sync::Arc;

use idemgate_server::{ConnLimits, PeerService};

use super::{InForce, StartError, redact, routes};

/// Binds the public listener and starts one worker per thread; the
/// address it is bound to (a port 0 resolved).
pub(super) async fn spawn(
    shared: &Arc<InForce>,
    tables: &tokio::sync::watch::Receiver<Arc<InForce>>,
    limits: ConnLimits,
    signal: &idemgate_server::ShutdownSignal,
    threads: usize,
) -> Result<(SocketAddr, Vec<std::thread::JoinHandle<()>>), StartError> {
    let config = &shared.config;
    let requested: SocketAddr =
        config
            .server
            .listen
            .parse()
            .map_err(|e: std::net::AddrParseError| StartError::Bind {
                key: "server.listen",
                addr: config.server.listen.clone(),
                source: std::io::Error::new(std::io::ErrorKind::InvalidInput, e),
            })?;
    // One listening socket, shared by every worker: each registers its own
    // handle of it with its own event loop, and whichever worker is free
    // accepts next — as nginx's workers share theirs. (Per-worker
    // `SO_REUSEPORT` sockets split connections by a hash, unevenly for a
    // few dozen keep-alive clients, and let a second gateway silently share
    // the port.)
    let listener = idemgate_server::bind_shared(requested).map_err(|source| StartError::Bind {
        key: "server.listen",
        addr: requested.to_string(),
        source,
    })?;
    let (balance, seats) = idemgate_server::balance::Balance::new(threads);
    shared.metrics.set_worker_balance(balance);
    let mut workers = Vec::with_capacity(threads);
    let mut public_addr = requested;
    for (i, seat) in seats.into_iter().enumerate() {
        let (ready, bound) = tokio::sync::oneshot::channel();
        let handle = listener.try_clone().map_err(|source| StartError::Bind {
            key: "server.listen",
            addr: requested.to_string(),
            source,
        })?;
        workers.push(spawn_worker(
            i,
            handle,
            seat,
            tables.clone(),
            limits.clone(),
            signal.clone(),
            ready,
        ));
        match bound.await {
            Ok(Ok(addr)) => public_addr = addr,
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(StartError::Route {
                    route: "server.worker_threads".into(),
                    reason: "a worker thread failed to start".into(),
                });
            }
        }
    }
    // Only the workers' handles keep the socket open from here on, so it
    // closes when the last worker stops accepting.
    drop(listener);
    Ok((public_addr, workers))
}

/// One public-listener thread: its own event loop, socket and stacks.
/// (Long by design: the thread's set-up in order — runtime, store, route
/// table, serve loop, reload watch — each owning what the next uses.)
fn spawn_worker(
    index: usize,
    listener: std::net::TcpListener,
    seat: idemgate_server::balance::Seat,
    mut tables: tokio::sync::watch::Receiver<Arc<InForce>>,
    limits: ConnLimits,
    signal: idemgate_server::ShutdownSignal,
    ready: tokio::sync::oneshot::Sender<Result<SocketAddr, StartError>>,
) -> std::thread::JoinHandle<()> {
    let shared = tables.borrow_and_update().clone();
    let key = "server.listen";
    let addr = listener
        .local_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    std::thread::Builder::new()
        .name(format!("idemgate-worker-{index}"))
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(source) => {
                    let _ = ready.send(Err(StartError::Bind {
                        key,
                        addr: addr.to_string(),
                        source,
                    }));
                    return;
                }
            };
            runtime.block_on(async move {
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(listener) => listener,
                    Err(source) => {
                        let _ = ready.send(Err(StartError::Bind {
                            key,
                            addr: addr.to_string(),
                            source,
                        }));
                        return;
                    }
                };
                let bound = listener.local_addr().unwrap_or(addr);
                let store = match idemgate_store::open_for_worker(
                    &shared.config.store.options(),
                    &shared.store,
                    shared.memory.clone(),
                    shared.metrics.clone(),
                    shared.workers,
                )
                .await
                {
                    Ok(store) => store,
                    Err(source) => {
                        let _ = ready.send(Err(StartError::Store {
                            url: redact(&shared.config.store.database_url),
                            source,
                        }));
                        return;
                    }
                };
                let router = match routes::build_router(&shared, &store) {
                    Ok(router) => router,
                    Err(e) => {
                        let _ = ready.send(Err(e));
                        return;
                    }
                };
                let _ = ready.send(Ok(bound));
                // A reload publishes new shared state: this worker builds
                // its own stacks from it (its own pools, its own store) and
                // swaps them in; requests in flight keep the old ones.
                let table = crate::router::Swappable::new(router);
                let swapping = table.clone();
                tokio::spawn(async move {
                    while tables.changed().await.is_ok() {
                        let next = tables.borrow_and_update().clone();
                        match routes::build_router(&next, &store) {
                            Ok(router) => swapping.replace(router),
                            Err(e) => tracing::error!(worker = index, error = %e, layer = "reload", "rebuilding the routes failed; this worker keeps the previous ones"),
                        }
                    }
                });
                // Claims outlive their connections: after the drain starts,
                // this loop stays up until the claims held here are
                // recorded, within the same grace.
                let mut stopping = signal.clone();
                let holders = shared.holders.clone();
                let grace = limits.shutdown_grace;
                let serving = idemgate_server::serve(
                    listener,
                    PeerService::factory(table),
                    limits,
                    Some(seat),
                    signal,
                );
                let held = async move {
                    stopping.wait().await;
                    holders.drain(grace).await;
                };
                tokio::join!(serving, held);
            });
        })
        .expect("spawning a worker thread")
}
