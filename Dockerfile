FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN cargo build --profile dist --features jemalloc --bins

FROM debian:bookworm-slim
COPY --from=build /src/target/dist/idemgate /src/target/dist/demo-upstream /usr/local/bin/
COPY config /etc/idemgate
WORKDIR /var/lib/idemgate
ENTRYPOINT []
