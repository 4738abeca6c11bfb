//! TLS on both sides: the public listener's certificate and the upstreams'
//! trust (rustls with the `ring` provider, TLS 1.2 and 1.3).
//!
//! This module owns reading PEM files and building rustls configurations,
//! so that every file problem is found at start-up and named by the config
//! key that points at it, and [`Stream`], the one byte stream type the
//! server and the upstream client run over, plain or encrypted.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// ALPN names, in the order the gateway prefers them.
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN name of HTTP/1.1.
pub const ALPN_HTTP1: &[u8] = b"http/1.1";

/// A TLS file or setting that cannot be used, with the config key that
/// names it.
#[derive(Debug, thiserror::Error)]
#[error("{key} = {path:?}: {reason}")]
pub struct TlsConfigError {
    /// The config key that names the file (`upstreams[2].ca_file`).
    pub key: String,
    /// The file's path as configured (empty when no file is at fault).
    pub path: String,
    /// Why it cannot be used.
    pub reason: String,
}

fn error(key: &str, path: &str, reason: impl ToString) -> TlsConfigError {
    TlsConfigError {
        key: key.to_owned(),
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

const VERSIONS: &[&rustls::SupportedProtocolVersion] =
    &[&rustls::version::TLS13, &rustls::version::TLS12];

/// Every certificate in a PEM file (a chain: leaf first).
fn certificates(key: &str, path: &str) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    if !Path::new(path).is_file() {
        return Err(error(key, path, "no such file"));
    }
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| error(key, path, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(key, path, e))?;
    if certs.is_empty() {
        return Err(error(key, path, "no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The first private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
fn private_key(key: &str, path: &str) -> Result<PrivateKeyDer<'static>, TlsConfigError> {
    if !Path::new(path).is_file() {
        return Err(error(key, path, "no such file"));
    }
    PrivateKeyDer::from_pem_file(path).map_err(|e| error(key, path, e))
}

/// The public listener's TLS configuration: `cert` (a PEM chain) and
/// `key`, offering `h2` over ALPN when `http2` is on.
pub fn server_config(
    cert_key: (&str, &str),
    key_key: (&str, &str),
    http2: bool,
) -> Result<Arc<rustls::ServerConfig>, TlsConfigError> {
    let certs = certificates(cert_key.0, cert_key.1)?;
    let key = private_key(key_key.0, key_key.1)?;
    let mut config = rustls::ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| error(cert_key.0, cert_key.1, e))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        // A key that does not match the certificate is refused here.
        .map_err(|e| error(key_key.0, key_key.1, e))?;
    config.alpn_protocols = if http2 {
        vec![ALPN_H2.to_vec(), ALPN_HTTP1.to_vec()]
    } else {
        vec![ALPN_HTTP1.to_vec()]
    };
    Ok(Arc::new(config))
}

/// What an upstream's TLS trusts and presents.
#[derive(Debug, Default, Clone)]
pub struct ClientFiles<'a> {
    /// `(config key, path)` of a PEM bundle to trust instead of the
    /// system roots.
    pub ca_file: Option<(&'a str, &'a str)>,
    /// `(config key, path)` of the client certificate chain (mutual TLS).
    pub client_cert: Option<(&'a str, &'a str)>,
    /// `(config key, path)` of its private key.
    pub client_key: Option<(&'a str, &'a str)>,
}

/// An upstream's TLS configuration, offering `h2` alone over ALPN when
/// `http2` is on (the gateway then speaks nothing else to it), `http/1.1`
/// otherwise.
pub fn client_config(
    files: &ClientFiles<'_>,
    http2: bool,
) -> Result<Arc<rustls::ClientConfig>, TlsConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    match files.ca_file {
        Some((key, path)) => {
            for cert in certificates(key, path)? {
                roots.add(cert).map_err(|e| error(key, path, e))?;
            }
        }
        None => {
            let native = rustls_native_certs::load_native_certs();
            let (added, _) = roots.add_parsable_certificates(native.certs);
            if added == 0 {
                tracing::warn!(layer = "tls", errors = ?native.errors, "no system root certificates found; https upstreams without ca_file will be refused");
            }
        }
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(VERSIONS)
        .map_err(|e| error("upstreams[].url", "", e))?
        .with_root_certificates(roots);
    let mut config = match (files.client_cert, files.client_key) {
        (Some(cert), Some(key)) => {
            let certs = certificates(cert.0, cert.1)?;
            let private = private_key(key.0, key.1)?;
            builder
                .with_client_auth_cert(certs, private)
                .map_err(|e| error(key.0, key.1, e))?
        }
        (None, None) => builder.with_no_client_auth(),
        (Some((key, path)), None) | (None, Some((key, path))) => {
            return Err(error(
                key,
                path,
                "client_cert and client_key go together (mutual TLS needs both)",
            ));
        }
    };
    config.alpn_protocols = if http2 {
        vec![ALPN_H2.to_vec()]
    } else {
        vec![ALPN_HTTP1.to_vec()]
    };
    Ok(Arc::new(config))
}

/// Whether an I/O error from a TLS handshake is TLS refusing the peer (an
/// untrusted or invalid certificate, a protocol mismatch), not the network
/// failing under it.
pub fn is_tls_refusal(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|inner| is_rustls_error(inner))
}

/// Whether `e` is the server refusing this client's handshake after the
/// client had finished it: over TLS 1.3 the client's half ends before the
/// server has checked the client certificate, so a refusal arrives as an
/// alert on the first read — and a server that refused the handshake
/// processed nothing. Only the alerts of that refusal (RFC 8446 §6.2:
/// certificate, access and handshake failures) count: any other TLS error
/// after the request's bytes left (a corrupt or undecryptable record, a
/// `bad_record_mac`, a close without `close_notify`) may follow a request
/// the server processed, and is not a refusal.
pub fn is_handshake_refusal(e: &(dyn std::error::Error + 'static)) -> bool {
    use rustls::AlertDescription as A;
    let rustls = e.downcast_ref::<rustls::Error>().or_else(|| {
        e.downcast_ref::<io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
    });
    matches!(
        rustls,
        Some(rustls::Error::AlertReceived(
            A::HandshakeFailure
                | A::BadCertificate
                | A::UnsupportedCertificate
                | A::CertificateRevoked
                | A::CertificateExpired
                | A::CertificateUnknown
                | A::UnknownCA
                | A::AccessDenied
                | A::InsufficientSecurity
                | A::CertificateRequired
        ))
    )
}

/// Whether `e` is rustls refusing the peer, or an I/O error carrying that.
pub fn is_rustls_error(e: &(dyn std::error::Error + 'static)) -> bool {
    if e.downcast_ref::<rustls::Error>().is_some() {
        return true;
    }
    e.downcast_ref::<io::Error>()
        .and_then(|io| io.get_ref())
        .is_some_and(|inner| inner.downcast_ref::<rustls::Error>().is_some())
}

/// A connection, plain or TLS: what the server and the upstream client
/// both run over. `T` is the TLS stream (server or client side).
#[derive(Debug)]
pub enum Stream<T> {
    /// Plain TCP.
    Plain(TcpStream),
    /// TLS over TCP, boxed to keep the enum small.
    Tls(Box<T>),
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncRead for Stream<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<T: AsyncRead + AsyncWrite + Unpin> AsyncWrite for Stream<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}
