FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --release --bins

FROM debian:bookworm-slim
COPY --from=build /src/target/release/idemgate /src/target/release/demo-upstream /usr/local/bin/
COPY config /etc/idemgate
WORKDIR /var/lib/idemgate
ENTRYPOINT []
