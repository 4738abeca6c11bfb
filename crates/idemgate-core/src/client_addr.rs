//! The peer a request came from, as the server hands it to every layer
//! above (a request extension): the proxy writes `X-Forwarded-*` from it,
//! the token endpoint scopes an anonymous client's issue rate by it.

use std::net::{IpAddr, SocketAddr};

use http::HeaderValue;

/// The peer a request came from (a request extension set by the server),
/// with its address already formatted for `X-Forwarded-For`: formatted once
/// per connection rather than once per request.
#[derive(Debug, Clone)]
pub struct ClientAddr {
    /// The peer's address (IPv4-mapped IPv6 as IPv4).
    pub addr: SocketAddr,
    ip_text: HeaderValue,
    /// Whether the client reached the gateway over TLS.
    secure: bool,
}

impl ClientAddr {
    /// The peer at `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        // A dual-stack listener sees IPv4 clients as `::ffff:a.b.c.d`;
        // upstreams get the address as the client has it.
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        let ip_text = match addr.ip() {
            // Once per connection, but `Display` for an address costs a
            // tenth of a whole request served on a new connection; octets
            // are cheap.
            IpAddr::V4(v4) => {
                let mut text = [0u8; 15];
                let len = ipv4_text(v4.octets(), &mut text);
                HeaderValue::from_bytes(&text[..len])
            }
            ip => HeaderValue::from_str(&ip.to_string()),
        }
        .expect("an IP address is a valid header value");
        ClientAddr {
            addr,
            ip_text,
            secure: false,
        }
    }

    /// Its IP address as `X-Forwarded-For` writes it.
    pub fn ip_text(&self) -> &HeaderValue {
        &self.ip_text
    }

    /// Whether it reached the gateway over TLS.
    pub fn is_secure(&self) -> bool {
        self.secure
    }

    /// The peer at `addr`, connected over TLS (`X-Forwarded-Proto: https`).
    pub fn secure(addr: SocketAddr) -> Self {
        ClientAddr {
            secure: true,
            ..ClientAddr::new(addr)
        }
    }
}

/// Writes `a.b.c.d` into `out`; returns its length.
fn ipv4_text(octets: [u8; 4], out: &mut [u8; 15]) -> usize {
    let mut len = 0;
    for (i, octet) in octets.into_iter().enumerate() {
        if i > 0 {
            out[len] = b'.';
            len += 1;
        }
        if octet >= 100 {
            out[len] = b'0' + octet / 100;
            len += 1;
        }
        if octet >= 10 {
            out[len] = b'0' + octet / 10 % 10;
            len += 1;
        }
        out[len] = b'0' + octet % 10;
        len += 1;
    }
    len
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_addresses_are_written_as_display_writes_them() {
        let mut octets = [0u8, 9, 10, 99, 100, 199, 200, 255];
        for seed in 0..4096u32 {
            octets.rotate_left(1);
            let ip = std::net::Ipv4Addr::new(
                octets[0],
                octets[(seed % 7) as usize + 1],
                (seed % 256) as u8,
                (seed / 16 % 256) as u8,
            );
            let client = ClientAddr::new(SocketAddr::from((ip, 4000)));
            assert_eq!(client.ip_text().to_str().unwrap(), ip.to_string());
        }
        let v6: SocketAddr = "[2001:db8::1]:443".parse().unwrap();
        assert_eq!(
            ClientAddr::new(v6).ip_text().to_str().unwrap(),
            "2001:db8::1"
        );
    }
}
