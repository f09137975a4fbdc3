//! A payment provider on loopback that honours `Idempotency-Key` as payment APIs do: a small
//! HTTP/1.1 server (one thread per connection) for tests, the chaos harness and the demo.
//!
//! `POST /charges` with a form body `item=ITEM&amount=N` makes a charge for `ITEM` and answers
//! `200 {"id":"ch_N","item":"ITEM","amount":N}`, after a configurable delay (the call's
//! latency). With an `Idempotency-Key` header:
//!
//! * the same key again, with the same body, replays the first answer (header
//!   `Idempotent-Replayed: true`) and charges nothing;
//! * the same key while its first request is still being processed answers
//!   `409 {"error":"conflict"}` and charges nothing (a concurrent duplicate);
//! * the same key with another body answers `422 {"error":"key reused"}`.
//!
//! Without the header every request charges. [`Provider::charges`] counts the charges made
//! per item: a count above one is a duplicate payment.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The longest request body accepted.
const MAX_BODY: usize = 64 * 1024;

#[derive(Debug, Default)]
struct State {
    /// Charges made, per item.
    charges: HashMap<String, u64>,
    /// Per idempotency key: the body it came with, and the answer once there is one.
    keys: HashMap<String, (String, Option<String>)>,
    requests: u64,
    replays: u64,
    conflicts: u64,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    latency_ms: AtomicU64,
    next_id: AtomicU64,
    stop: AtomicBool,
}

/// A running fake payment provider. Dropping it stops accepting connections.
#[derive(Debug)]
pub struct Provider {
    port: u16,
    shared: Arc<Shared>,
}

impl Provider {
    /// Starts it on a free loopback port, answering after `latency`.
    ///
    /// # Errors
    /// When no loopback port can be bound.
    pub fn start(latency: Duration) -> std::io::Result<Self> {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
        let port = listener.local_addr()?.port();
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            latency_ms: AtomicU64::new(u64::try_from(latency.as_millis()).unwrap_or(u64::MAX)),
            next_id: AtomicU64::new(1),
            stop: AtomicBool::new(false),
        });
        let accept = shared.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if accept.stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok(conn) = conn {
                    let shared = accept.clone();
                    std::thread::spawn(move || serve(&shared, conn));
                }
            }
        });
        Ok(Self { port, shared })
    }

    /// Its base URL, `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Its port.
    #[must_use]
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Changes how long a charge takes.
    pub fn set_latency(&self, latency: Duration) {
        self.shared.latency_ms.store(
            u64::try_from(latency.as_millis()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
    }

    /// Charges made for `item`.
    #[must_use]
    pub fn charges(&self, item: &str) -> u64 {
        self.lock().charges.get(item).copied().unwrap_or(0)
    }

    /// Charges made per item.
    #[must_use]
    pub fn all_charges(&self) -> HashMap<String, u64> {
        self.lock().charges.clone()
    }

    /// Items charged more than once, with their charge counts.
    #[must_use]
    pub fn duplicates(&self) -> Vec<(String, u64)> {
        let mut d: Vec<_> = self
            .lock()
            .charges
            .iter()
            .filter(|(_, n)| **n > 1)
            .map(|(i, n)| (i.clone(), *n))
            .collect();
        d.sort();
        d
    }

    /// Requests received, answers replayed for a known key, and concurrent duplicates refused.
    #[must_use]
    pub fn counts(&self) -> (u64, u64, u64) {
        let s = self.lock();
        (s.requests, s.replays, s.conflicts)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Provider {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Relaxed);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port));
    }
}

/// An HTTP answer: status code and body.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The status code.
    pub status: u16,
    /// The body.
    pub body: String,
    /// Whether the provider replayed an earlier answer (`Idempotent-Replayed: true`).
    pub replayed: bool,
}

/// `POST {base}/charges` with body `item=ITEM&amount=AMOUNT` and, when given, an
/// `Idempotency-Key` header: a minimal HTTP/1.1 client (one connection per request), for
/// code that has no HTTP client of its own. Gives up after `timeout`.
///
/// # Errors
/// When the provider cannot be reached or answers something that is not HTTP.
pub fn charge(
    base: &str,
    key: Option<&str>,
    item: &str,
    amount: i64,
    timeout: Duration,
) -> std::io::Result<Answer> {
    let addr = base
        .strip_prefix("http://")
        .ok_or_else(|| std::io::Error::other("only http:// URLs"))?
        .trim_end_matches('/');
    let mut stream = TcpStream::connect(addr)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let body = format!("item={item}&amount={amount}");
    let mut request = format!(
        "POST /charges HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/x-www-form-urlencoded\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(key) = key {
        request.push_str(&format!("Idempotency-Key: {key}\r\n"));
    }
    request.push_str("\r\n");
    request.push_str(&body);
    stream.write_all(request.as_bytes())?;
    let mut reader = BufReader::new(stream);
    let mut status_line = String::new();
    reader.read_line(&mut status_line)?;
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not HTTP: {status_line:?}")))?;
    let (headers, _) = read_headers(&mut reader)?;
    let replayed = headers
        .iter()
        .any(|(k, v)| k == "idempotent-replayed" && v == "true");
    let mut body = String::new();
    reader.read_to_string(&mut body)?;
    Ok(Answer {
        status,
        body,
        replayed,
    })
}

/// Header names lower-cased, and the Content-Length.
fn read_headers(reader: &mut impl BufRead) -> std::io::Result<(Vec<(String, String)>, usize)> {
    let mut headers = Vec::new();
    let mut length = 0;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line)? == 0 {
            break;
        }
        let line = line.trim_end();
        if line.is_empty() {
            break;
        }
        if let Some((name, value)) = line.split_once(':') {
            let (name, value) = (name.trim().to_ascii_lowercase(), value.trim().to_owned());
            if name == "content-length" {
                length = value.parse().unwrap_or(0);
            }
            headers.push((name, value));
        }
        if headers.len() > 100 {
            break;
        }
    }
    Ok((headers, length))
}

fn serve(shared: &Shared, stream: TcpStream) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
    let Ok(write) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut request_line = String::new();
    if reader.read_line(&mut request_line).is_err() || request_line.is_empty() {
        return;
    }
    let Ok((headers, length)) = read_headers(&mut reader) else {
        return;
    };
    let mut body = vec![0; length.min(MAX_BODY)];
    if reader.read_exact(&mut body).is_err() {
        return;
    }
    let body = String::from_utf8_lossy(&body).into_owned();
    let key = headers
        .iter()
        .find(|(k, _)| k == "idempotency-key")
        .map(|(_, v)| v.clone());
    let (status, answer, replayed) = if request_line.starts_with("POST /charges ") {
        handle_charge(shared, key, &body)
    } else {
        (404, r#"{"error":"not found"}"#.to_owned(), false)
    };
    respond(write, status, &answer, replayed);
}

fn handle_charge(shared: &Shared, key: Option<String>, body: &str) -> (u16, String, bool) {
    let form: HashMap<&str, &str> = body.split('&').filter_map(|p| p.split_once('=')).collect();
    let (Some(item), Some(amount)) = (form.get("item"), form.get("amount")) else {
        return (
            400,
            r#"{"error":"item and amount are required"}"#.to_owned(),
            false,
        );
    };
    let (item, amount) = ((*item).to_owned(), (*amount).to_owned());
    {
        let mut s = shared
            .state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.requests += 1;
        if let Some(key) = &key {
            match s.keys.get(key).cloned() {
                Some((first_body, _)) if first_body != body => {
                    return (422, r#"{"error":"key reused"}"#.to_owned(), false);
                }
                Some((_, Some(answer))) => {
                    s.replays += 1;
                    return (200, answer, true);
                }
                Some((_, None)) => {
                    s.conflicts += 1;
                    return (409, r#"{"error":"conflict"}"#.to_owned(), false);
                }
                None => {
                    s.keys.insert(key.clone(), (body.to_owned(), None));
                }
            }
        }
    }
    std::thread::sleep(Duration::from_millis(
        shared.latency_ms.load(Ordering::Relaxed),
    ));
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let answer = format!(r#"{{"id":"ch_{id}","item":"{item}","amount":{amount}}}"#);
    let mut s = shared
        .state
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *s.charges.entry(item).or_insert(0) += 1;
    if let Some(key) = key {
        s.keys.insert(key, (body.to_owned(), Some(answer.clone())));
    }
    (200, answer, false)
}

fn respond(mut stream: TcpStream, status: u16, body: &str, replayed: bool) {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        404 => "Not Found",
        409 => "Conflict",
        _ => "Unprocessable Entity",
    };
    let extra = if replayed {
        "Idempotent-Replayed: true\r\n"
    } else {
        ""
    };
    let _ = write!(
        stream,
        "HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n{extra}Connection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.flush();
    let _ = stream.shutdown(Shutdown::Write);
}
