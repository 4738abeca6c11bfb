//! `demo-upstream`: a small order, payment and coupon service.
//!
//! It is the example of the innermost idempotency layer — the business state
//! machine: a coupon deduction moves `UNUSED → USED` and a payment
//! notification moves an order `WAIT_PAY → PAID` in one critical section, and
//! a repeat answers success without acting again. It counts every real
//! execution per action and key (`GET /stats`), which is the oracle the tests
//! and load tests use, and has fault switches (see [`faults`]): slow, fail,
//! and commit-then-drop-the-connection (the lost-ACK incident).
//!
//! `POST /actions/{name}` is deliberately *not* idempotent: it executes on
//! every call, so a test can see any duplicate that slipped through.
//!
//! # Layout
//!
//! - `handlers.rs`: the routes (orders, coupons, payments, actions, the
//!   status endpoint, stats, faults).
//! - `state.rs`: the business state and the execution counts.
//! - [`faults`]: the fault switches.
#![warn(missing_docs)]

pub mod faults;
mod handlers;
mod state;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::task::JoinHandle;
use tower::ServiceExt;

pub use faults::{DropConnection, FaultPlan};
pub use state::{DemoState, Stats};

use idemgate_server::{ConnLimits, ShutdownTrigger};

/// A demo upstream running in this process.
pub struct DemoUpstream {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its business state and counters.
    pub state: Arc<DemoState>,
    trigger: ShutdownTrigger,
    task: JoinHandle<()>,
}

impl DemoUpstream {
    /// Stops it, letting in-flight requests finish.
    pub async fn shutdown(self) {
        self.trigger.trigger();
        let _ = self.task.await;
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// Starts the demo upstream on `addr` (`127.0.0.1:0` for a free port),
/// speaking HTTP/1.1 and h2c.
pub async fn start(addr: &str) -> std::io::Result<DemoUpstream> {
    start_with_tls(addr, None).await
}

/// Starts the demo upstream, terminating TLS with `tls` when given (ALPN
/// as that configuration offers it).
pub async fn start_with_tls(
    addr: &str,
    tls: Option<Arc<rustls::ServerConfig>>,
) -> std::io::Result<DemoUpstream> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let addr = listener.local_addr()?;
    let state = Arc::new(DemoState::default());
    let app = handlers::router(state.clone());
    let (trigger, signal) = idemgate_server::shutdown_pair();
    let limits = ConnLimits {
        tls,
        ..ConnLimits::plain(Duration::from_secs(30), 10_000, Duration::from_secs(30))
    };
    let service_state = state.clone();
    let task = tokio::spawn(idemgate_server::serve(
        listener,
        move |_peer, _tls, _claims| DemoService {
            app: app.clone(),
            state: service_state.clone(),
        },
        limits,
        None,
        signal,
    ));
    Ok(DemoUpstream {
        addr,
        state,
        trigger,
        task,
    })
}

/// Runs the axum app, and turns a [`DropConnection`] answer into a service
/// error: hyper then closes the connection without writing any response,
/// which is exactly what a client sees when an acknowledgement is lost.
#[derive(Clone)]
struct DemoService {
    app: axum::Router,
    state: Arc<DemoState>,
}

impl hyper::service::Service<Request<Incoming>> for DemoService {
    type Response = Response<Body>;
    type Error = std::io::Error;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Response<Body>, std::io::Error>> + Send>,
    >;

    fn call(&self, req: Request<Incoming>) -> Self::Future {
        if req.version() == http::Version::HTTP_2 {
            self.state.saw_http2();
        }
        let app = self.app.clone();
        // Like most real services, finish the business action even if the
        // caller goes away mid-request: the handler runs as its own task, so
        // a dropped connection cannot cancel a commit half-way. (This is what
        // makes "the gateway died after forwarding" a real lost-ACK case.)
        let work = tokio::spawn(async move {
            let response: Result<Response<Body>, Infallible> =
                app.oneshot(req.map(Body::new)).await;
            response
        });
        Box::pin(async move {
            let Ok(Ok(response)) = work.await else {
                return Err(std::io::Error::other("demo handler panicked"));
            };
            if response.extensions().get::<DropConnection>().is_some() {
                return Err(std::io::Error::other("demo fault: connection dropped"));
            }
            Ok(response)
        })
    }
}
