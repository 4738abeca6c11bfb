//! Generated certificates and a TLS test client.
//!
//! [`Pki`] writes a certificate authority, a server certificate for
//! `localhost` and `127.0.0.1`, a client certificate, and a second,
//! unrelated authority (whose certificates nobody trusts) into a temporary
//! directory, as PEM files the gateway's config can point at.

use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Version};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use super::Answer;

/// Certificates on disk.
pub struct Pki {
    _dir: tempfile::TempDir,
    /// The trusted authority.
    pub ca: PathBuf,
    /// A server chain and key signed by it, for `localhost`/`127.0.0.1`.
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    /// A client chain and key signed by it.
    pub client_cert: PathBuf,
    pub client_key: PathBuf,
    /// A server chain and key for the same names, signed by an authority
    /// that nobody trusts.
    pub rogue_cert: PathBuf,
    pub rogue_key: PathBuf,
}

fn authority(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap()
}

fn leaf(issuer: &CertifiedIssuer<'static, KeyPair>, names: &[&str]) -> (String, String) {
    let params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>()).unwrap();
    let key = KeyPair::generate().unwrap();
    let cert = params.signed_by(&key, issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

impl Pki {
    pub fn generate() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let ca = authority("idemgate test CA");
        let rogue = authority("nobody trusts this CA");
        let write = |name: &str, text: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let (server, server_key) = leaf(&ca, &["localhost", "127.0.0.1"]);
        let (client, client_key) = leaf(&ca, &["idemgate-client"]);
        let (rogue_cert, rogue_key) = leaf(&rogue, &["localhost", "127.0.0.1"]);
        Pki {
            ca: write("ca.pem", &ca.pem()),
            server_cert: write("server.pem", &server),
            server_key: write("server.key", &server_key),
            client_cert: write("client.pem", &client),
            client_key: write("client.key", &client_key),
            rogue_cert: write("rogue.pem", &rogue_cert),
            rogue_key: write("rogue.key", &rogue_key),
            _dir: dir,
        }
    }

    fn provider() -> Arc<rustls::crypto::CryptoProvider> {
        Arc::new(rustls::crypto::ring::default_provider())
    }

    fn certs(path: &PathBuf) -> Vec<CertificateDer<'static>> {
        CertificateDer::pem_file_iter(path)
            .unwrap()
            .map(|c| c.unwrap())
            .collect()
    }

    fn roots(&self) -> rustls::RootCertStore {
        let mut roots = rustls::RootCertStore::empty();
        for cert in Self::certs(&self.ca) {
            roots.add(cert).unwrap();
        }
        roots
    }

    /// A server configuration for an upstream: `rogue` picks the untrusted
    /// chain, `require_client` demands a client certificate from this CA.
    pub fn upstream_config(
        &self,
        rogue: bool,
        require_client: bool,
        alpn: &[&[u8]],
    ) -> Arc<rustls::ServerConfig> {
        let (cert, key) = if rogue {
            (&self.rogue_cert, &self.rogue_key)
        } else {
            (&self.server_cert, &self.server_key)
        };
        let builder = rustls::ServerConfig::builder_with_provider(Self::provider())
            .with_safe_default_protocol_versions()
            .unwrap();
        let builder = if require_client {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(self.roots()),
                Self::provider(),
            )
            .build()
            .unwrap();
            builder.with_client_cert_verifier(verifier)
        } else {
            builder.with_no_client_auth()
        };
        let mut config = builder
            .with_single_cert(
                Self::certs(cert),
                PrivateKeyDer::from_pem_file(key).unwrap(),
            )
            .unwrap();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Arc::new(config)
    }

    /// A client trusting this CA, offering `alpn`.
    pub fn client(&self, alpn: &[&[u8]]) -> TlsClient {
        let mut config = rustls::ClientConfig::builder_with_provider(Self::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(self.roots())
            .with_no_client_auth();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        TlsClient {
            connector: tokio_rustls::TlsConnector::from(Arc::new(config)),
        }
    }
}

/// A TLS client: one connection per [`TlsClient::connect`], HTTP/2 when
/// ALPN agreed on `h2`, HTTP/1.1 otherwise.
#[derive(Clone)]
pub struct TlsClient {
    connector: tokio_rustls::TlsConnector,
}

/// One client connection.
pub enum TlsConn {
    Http1(hyper::client::conn::http1::SendRequest<Full<Bytes>>),
    Http2(hyper::client::conn::http2::SendRequest<Full<Bytes>>),
}

impl TlsClient {
    pub async fn connect(&self, addr: std::net::SocketAddr) -> Result<TlsConn, std::io::Error> {
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let tls = self
            .connector
            .connect(ServerName::try_from("localhost").unwrap(), tcp)
            .await?;
        let h2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
        let io = TokioIo::new(tls);
        Ok(if h2 {
            let (send, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(conn);
            TlsConn::Http2(send)
        } else {
            let (send, conn) = hyper::client::conn::http1::handshake(io)
                .await
                .map_err(std::io::Error::other)?;
            tokio::spawn(conn);
            TlsConn::Http1(send)
        })
    }
}

impl TlsConn {
    pub fn version(&self) -> Version {
        match self {
            TlsConn::Http1(_) => Version::HTTP_11,
            TlsConn::Http2(_) => Version::HTTP_2,
        }
    }

    /// Sends one request to `https://localhost{path}`.
    pub async fn send(
        &mut self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &str,
    ) -> Answer {
        let mut request = Request::builder().method(method);
        request = match self {
            TlsConn::Http1(_) => request.uri(path).header("host", "localhost"),
            TlsConn::Http2(_) => request.uri(format!("https://localhost{path}")),
        };
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(Bytes::from(body.to_owned())))
            .unwrap();
        let response = match self {
            TlsConn::Http1(s) => {
                s.ready().await.unwrap();
                s.send_request(request).await
            }
            TlsConn::Http2(s) => {
                s.ready().await.unwrap();
                s.send_request(request).await
            }
        }
        .unwrap();
        let (parts, body) = response.into_parts();
        Answer {
            status: parts.status,
            headers: parts.headers,
            body: body.collect().await.unwrap().to_bytes(),
        }
    }
}
