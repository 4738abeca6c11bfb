//! `demo-upstream [ADDR]`: the demo order/payment/coupon service on its own
//! (default `127.0.0.1:9001`, or `DEMO_UPSTREAM_LISTEN`).

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IDEMGATE_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let addr = std::env::args()
        .nth(1)
        .or_else(|| std::env::var("DEMO_UPSTREAM_LISTEN").ok())
        .unwrap_or_else(|| "127.0.0.1:9001".into());
    let upstream = match idemgate::demo_upstream::start(&addr).await {
        Ok(u) => u,
        Err(e) => {
            eprintln!("demo-upstream: cannot listen on {addr}: {e}");
            std::process::exit(1);
        }
    };
    println!("demo-upstream listening on http://{}", upstream.addr);
    idemgate::server::termination().await;
    upstream.shutdown().await;
}
