//! The metrics endpoint: a deliberately small HTTP/1.1 server. It answers `GET /metrics` and
//! `GET /healthz`, closes every connection after one response, and bounds what a client can
//! cost: request heads over 8 KiB are refused, a client gets 5 s for its TLS handshake and its
//! whole request head, connections are capped. Optionally TLS (rustls) and basic auth on
//! /metrics (config `[http]`).

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpListener,
    sync::Semaphore,
};
use tokio_rustls::{
    TlsAcceptor,
    rustls::{
        self, ServerConfig,
        pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    },
};

use crate::{
    serve::exposition::Format,
    serve::metrics::{self, State},
};

const MAX_HEAD: usize = 8 * 1024;
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 64;

/// TLS and basic auth of the metrics endpoint, as the config names them (files are read and
/// checked when the server starts: `Security::load`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HttpSecurity {
    /// PEM certificate chain and private key.
    pub tls: Option<(std::path::PathBuf, std::path::PathBuf)>,
    /// User name and a file holding the password (its first line).
    pub basic_auth: Option<(String, std::path::PathBuf)>,
}

/// Binds the listen address, with advice when it cannot.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| {
        let advice = match e.kind() {
            std::io::ErrorKind::AddrInUse => {
                "the address is in use: is another tracerd running? Pick another with --listen ADDR:PORT"
            }
            std::io::ErrorKind::PermissionDenied => "permission denied: use a port above 1023 or run as root",
            std::io::ErrorKind::AddrNotAvailable => "no local interface has that address",
            _ => "check the --listen address",
        };
        anyhow::anyhow!("cannot listen on {addr}: {e}; {advice}")
    })
}

/// TLS and basic auth, loaded and checked at start.
#[derive(Clone, Default)]
pub struct Security {
    tls: Option<TlsAcceptor>,
    /// The whole `Authorization` header value a client must send: `Basic base64(user:pass)`.
    authorization: Option<String>,
}

impl Security {
    /// Reads the certificate, key and password files the config names.
    pub fn load(config: &HttpSecurity) -> Result<Security> {
        let tls = match &config.tls {
            Some((cert, key)) => Some(tls_acceptor(cert, key)?),
            None => None,
        };
        let authorization = match &config.basic_auth {
            Some((user, file)) => {
                let text = std::fs::read_to_string(file).with_context(|| {
                    format!("http.basic_auth_password_file: cannot read {}", file.display())
                })?;
                let password = text.lines().next().unwrap_or("");
                if password.is_empty() {
                    anyhow::bail!(
                        "http.basic_auth_password_file: {} has no password on its first line",
                        file.display()
                    );
                }
                Some(format!("Basic {}", base64(format!("{user}:{password}").as_bytes())))
            }
            None => None,
        };
        if authorization.is_some() && tls.is_none() {
            tracing::warn!("basic auth without TLS: the password crosses the network in clear");
        }
        Ok(Security { tls, authorization })
    }

    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() { "https" } else { "http" }
    }
}

fn tls_acceptor(cert: &std::path::Path, key: &std::path::Path) -> Result<TlsAcceptor> {
    let certs =
        CertificateDer::pem_file_iter(cert).and_then(|certs| certs.collect::<Result<Vec<_>, _>>()).map_err(
            |e| anyhow::anyhow!("http.tls_cert_file: cannot read certificates from {}: {e}", cert.display()),
        )?;
    if certs.is_empty() {
        anyhow::bail!("http.tls_cert_file: {} holds no PEM certificate", cert.display());
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        anyhow::anyhow!("http.tls_key_file: cannot read a private key from {}: {e}", key.display())
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .and_then(|b| b.with_no_client_auth().with_single_cert(certs, key))
        .context("http.tls_cert_file / http.tls_key_file: the key does not fit the certificate")?;
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Standard base64 with padding (RFC 4648), for the basic-auth header.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Equality that takes the same time wherever the first difference is (credentials).
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Serves /metrics and /healthz, and with `api` (config `[api] http = true`) the agent's API
/// read-only: `/api/v1/status` and `/api/v1/window?from_unix_s=F&to_unix_s=T`, behind the same
/// TLS and basic auth.
pub async fn serve(
    listener: TcpListener,
    state: Arc<Mutex<State>>,
    security: Security,
    api: Option<Arc<crate::serve::api::Shared>>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    let security = Arc::new(security);
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(stream); // over the cap: refuse rather than queue
            continue;
        };
        let (state, security, api) = (state.clone(), security.clone(), api.clone());
        tokio::spawn(async move {
            let _ = match &security.tls {
                Some(acceptor) => {
                    match tokio::time::timeout(READ_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => handle(tls, &state, &security, api).await,
                        _ => Ok(()), // a failed or slow handshake: nothing to answer
                    }
                }
                None => handle(stream, &state, &security, api).await,
            };
            drop(permit);
        });
    }
}

/// `/api/v1/...` as the socket's requests; None for any other path.
fn api_request(head: &[u8]) -> Option<String> {
    let line = String::from_utf8_lossy(head.split(|&b| b == b'\n').next().unwrap_or_default()).into_owned();
    let target = line.split_whitespace().nth(1)?;
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let param = |key: &str| {
        query
            .split('&')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.to_owned())
    };
    let number =
        |key: &str| param(key).and_then(|v| v.parse::<f64>().ok()).map_or("null".into(), |v| v.to_string());
    match path {
        "/api/v1/status" => Some(r#"{"version":1,"request":"status"}"#.into()),
        "/api/v1/window" => Some(format!(
            r#"{{"version":1,"request":"window","from_unix_s":{},"to_unix_s":{}}}"#,
            number("from_unix_s"),
            number("to_unix_s")
        )),
        p if p.starts_with("/api/") => Some(r#"{"version":1,"request":"unknown"}"#.into()),
        _ => None,
    }
}

/// Reads the request head: at most MAX_HEAD bytes, all of it within READ_TIMEOUT (a client
/// trickling bytes gets no more time than one sending nothing).
async fn read_head(stream: &mut (impl AsyncRead + Unpin)) -> Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                return Ok::<_, std::io::Error>(None);
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
                return Ok(Some(std::mem::take(&mut head)));
            }
            if head.len() > MAX_HEAD {
                return Ok(Some(Vec::new()));
            }
        }
    };
    Ok(tokio::time::timeout(READ_TIMEOUT, read).await.context("timeout")??)
}

async fn handle(
    mut stream: impl AsyncRead + AsyncWrite + Unpin,
    state: &Mutex<State>,
    security: &Security,
    api: Option<Arc<crate::serve::api::Shared>>,
) -> Result<()> {
    let Some(head) = read_head(&mut stream).await? else { return Ok(()) };
    let request = api.as_ref().and(api_request(&head));
    let get = head.starts_with(b"GET ") || head.starts_with(b"HEAD ");
    let (status, content_type, body) = if !authorized(&head, security) {
        ("401 Unauthorized", "text/plain; charset=utf-8", b"authentication required\n".to_vec())
    } else if let (Some(api), Some(request), true) = (api, request, get) {
        // A long window takes a while to add up: off the thread that reads the ring buffer.
        let answer = tokio::task::spawn_blocking(move || api.answer(request.as_bytes())).await?;
        let failed = answer.starts_with("{\"error\"");
        (if failed { "400 Bad Request" } else { "200 OK" }, "application/json", (answer + "\n").into_bytes())
    } else {
        route(&head, state)
    };
    let challenge =
        if status.starts_with("401") { "WWW-Authenticate: Basic realm=\"tracerd\"\r\n" } else { "" };
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{challenge}Connection: close\r\n\r\n",
        body.len()
    );
    let head_only = head.starts_with(b"HEAD ");
    tokio::time::timeout(READ_TIMEOUT, async {
        stream.write_all(header.as_bytes()).await?;
        if !head_only {
            stream.write_all(&body).await?;
        }
        stream.shutdown().await
    })
    .await
    .context("write timeout")??;
    Ok(())
}

/// Whether the request may proceed: no auth configured, the health path (liveness probes), or
/// the right `Authorization` header.
fn authorized(head: &[u8], security: &Security) -> bool {
    let Some(expected) = &security.authorization else { return true };
    let text = String::from_utf8_lossy(head);
    let mut lines = text.lines();
    let target = lines.next().and_then(|l| l.split_whitespace().nth(1)).unwrap_or("");
    if target.split('?').next() == Some("/healthz") {
        return true;
    }
    lines.filter_map(|l| l.split_once(':')).any(|(name, value)| {
        name.trim().eq_ignore_ascii_case("authorization")
            && constant_time_eq(value.trim().as_bytes(), expected.as_bytes())
    })
}

/// The value of header `name` in a request head.
fn header_value(head: &[u8], name: &str) -> Option<String> {
    String::from_utf8_lossy(head).lines().skip(1).find_map(|l| {
        let (n, v) = l.split_once(':')?;
        n.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
    })
}

fn route(head: &[u8], state: &Mutex<State>) -> (&'static str, &'static str, Vec<u8>) {
    const TEXT: &str = "text/plain; charset=utf-8";
    if head.is_empty() {
        return ("431 Request Header Fields Too Large", TEXT, "request head too large\n".into());
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, target) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    if method != "GET" && method != "HEAD" {
        return ("405 Method Not Allowed", TEXT, "only GET and HEAD\n".into());
    }
    match target.split('?').next().unwrap_or("") {
        "/metrics" => {
            // Text by default; OpenMetrics (exemplars) or protobuf (native histograms) when the
            // scraper asks.
            let format = Format::negotiate(header_value(head, "accept").as_deref());
            let (content_type, body) =
                metrics::render_as(&state.lock().unwrap_or_else(|e| e.into_inner()), format);
            ("200 OK", content_type, body)
        }
        "/healthz" => ("200 OK", TEXT, "ok\n".into()),
        "/" => ("200 OK", TEXT, "tracerd: metrics at /metrics, health at /healthz\n".into()),
        _ => ("404 Not Found", TEXT, "not found: try /metrics\n".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes() {
        let state = Mutex::new(State::default());
        assert_eq!(route(b"GET /metrics HTTP/1.1\r\n\r\n", &state).0, "200 OK");
        let text = |head: &[u8]| String::from_utf8_lossy(&route(head, &state).2).into_owned();
        assert!(text(b"GET /metrics HTTP/1.1\r\n\r\n").contains("tracerd_events_lost_total"));
        // Content negotiation: OpenMetrics ends with # EOF, protobuf is binary.
        let om = b"GET /metrics HTTP/1.1\r\nAccept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n\r\n";
        assert_eq!(route(om, &state).1, "application/openmetrics-text; version=1.0.0; charset=utf-8");
        assert!(text(om).ends_with("# EOF\n") && text(om).contains("# TYPE tracerd_events_lost counter"));
        let pb = b"GET /metrics HTTP/1.1\r\naccept: application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited\r\n\r\n";
        assert!(route(pb, &state).1.starts_with("application/vnd.google.protobuf"));
        assert!(!text(b"GET /metrics HTTP/1.1\r\n\r\n").contains("# EOF"), "text stays the default");
        assert_eq!(route(b"GET /healthz HTTP/1.0\r\n\r\n", &state).0, "200 OK");
        assert_eq!(route(b"GET /etc/passwd HTTP/1.1\r\n\r\n", &state).0, "404 Not Found");
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n", &state).0, "405 Method Not Allowed");
        assert_eq!(route(b"\x00\xff garbage\r\n\r\n", &state).0, "405 Method Not Allowed");
        assert_eq!(route(b"", &state).0, "431 Request Header Fields Too Large");
    }

    #[test]
    fn basic_auth() {
        assert_eq!(base64(b"prometheus:s3cret"), "cHJvbWV0aGV1czpzM2NyZXQ=");
        assert_eq!(
            (base64(b"a"), base64(b"ab"), base64(b"abc")),
            ("YQ==".into(), "YWI=".into(), "YWJj".into())
        );
        let open = Security::default();
        let locked = Security { tls: None, authorization: Some("Basic cHJvbWV0aGV1czpzM2NyZXQ=".into()) };
        let get = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
        assert!(authorized(get, &open));
        assert!(!authorized(get, &locked));
        assert!(authorized(
            b"GET /metrics HTTP/1.1\r\nauthorization: Basic cHJvbWV0aGV1czpzM2NyZXQ=\r\n\r\n",
            &locked
        ));
        assert!(!authorized(
            b"GET /metrics HTTP/1.1\r\nAuthorization: Basic cHJvbWV0aGV1czpzM2NyZXR=\r\n\r\n",
            &locked
        ));
        assert!(authorized(b"GET /healthz HTTP/1.1\r\n\r\n", &locked), "liveness probes need no password");
    }
}
