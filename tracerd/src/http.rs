//! The metrics endpoint: a deliberately small HTTP/1.1 server. It answers `GET /metrics` and
//! `GET /healthz`, closes every connection after one response, and bounds what a client can
//! cost: request heads over 8 KiB are refused, slow clients time out, connections are capped.

use std::{
    net::SocketAddr,
    sync::{Arc, Mutex},
    time::Duration,
};

use anyhow::{Context, Result};
use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
    sync::Semaphore,
};

use crate::metrics::{self, State};

const MAX_HEAD: usize = 8 * 1024;
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const MAX_CONNECTIONS: usize = 64;

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

pub async fn serve(listener: TcpListener, state: Arc<Mutex<State>>) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            drop(stream); // over the cap: refuse rather than queue
            continue;
        };
        let state = state.clone();
        tokio::spawn(async move {
            let _ = handle(stream, &state).await;
            drop(permit);
        });
    }
}

/// Reads the request head, up to MAX_HEAD bytes and READ_TIMEOUT.
async fn read_head(stream: &mut TcpStream) -> Result<Option<Vec<u8>>> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    loop {
        let n = tokio::time::timeout(READ_TIMEOUT, stream.read(&mut buf)).await.context("timeout")??;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
        if head.windows(4).any(|w| w == b"\r\n\r\n") || head.windows(2).any(|w| w == b"\n\n") {
            return Ok(Some(head));
        }
        if head.len() > MAX_HEAD {
            return Ok(Some(Vec::new()));
        }
    }
}

async fn handle(mut stream: TcpStream, state: &Mutex<State>) -> Result<()> {
    let Some(head) = read_head(&mut stream).await? else { return Ok(()) };
    let (status, content_type, body) = route(&head, state);
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let head_only = head.starts_with(b"HEAD ");
    tokio::time::timeout(READ_TIMEOUT, async {
        stream.write_all(header.as_bytes()).await?;
        if !head_only {
            stream.write_all(body.as_bytes()).await?;
        }
        stream.shutdown().await
    })
    .await
    .context("write timeout")??;
    Ok(())
}

fn route(head: &[u8], state: &Mutex<State>) -> (&'static str, &'static str, String) {
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
            let body = metrics::render(&state.lock().unwrap_or_else(|e| e.into_inner()));
            ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
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
        assert!(route(b"GET /metrics HTTP/1.1\r\n\r\n", &state).2.contains("tracerd_events_lost_total"));
        assert_eq!(route(b"GET /healthz HTTP/1.0\r\n\r\n", &state).0, "200 OK");
        assert_eq!(route(b"GET /etc/passwd HTTP/1.1\r\n\r\n", &state).0, "404 Not Found");
        assert_eq!(route(b"POST /metrics HTTP/1.1\r\n\r\n", &state).0, "405 Method Not Allowed");
        assert_eq!(route(b"\x00\xff garbage\r\n\r\n", &state).0, "405 Method Not Allowed");
        assert_eq!(route(b"", &state).0, "431 Request Header Fields Too Large");
    }
}
