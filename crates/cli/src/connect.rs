//! Connections to the servers, and taking a lock on one.

use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use pgfence::{
    Lease, RedisIssuer, Resource, TokenIssuer,
    issuer::{IssuerKind, IssuerOptions, PgIssuer},
};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::{Connection, PgConnection, PgPool, Postgres, Transaction};
use tokio::time::Instant;

use crate::cli::Conn;
use crate::util::{cell, fmt_duration, redact};

/// How long establishing a connection may take before the command gives up.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a pool checkout may wait (the CLI's pool is small and lightly used).
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long [`close_all`] waits, in all, for the pools' connections to come back and close.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(3);

/// Every PostgreSQL pool this process opened ([`connect_pg_with`], the PostgreSQL issuer's),
/// for [`close_all`]. A clone of a pool is the pool: closing it closes the one the command
/// used.
static OPENED: std::sync::Mutex<Vec<PgPool>> = std::sync::Mutex::new(Vec::new());

/// Remembers `pool` for [`close_all`].
fn opened(pool: &PgPool) {
    OPENED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(pool.clone());
}

/// Closes every pool this process opened, gracefully, so that the server sees each client
/// say goodbye: no "could not receive data from client: Connection reset by peer" or "could
/// not send data to client: Broken pipe" in its log.
///
/// First it waits until every connection is back in its pool: a connection given back (a
/// transaction dropped on an error path or by Ctrl-C queues its `ROLLBACK` unsent) is
/// checked by the pool with a round trip that sends what is queued and reads the answers. A
/// closed pool skips that check and sends Terminate right behind the queued `ROLLBACK`, and
/// the server's answer to it then reaches a socket already closed: the client's kernel
/// answers with a reset, which is what the server logs. Then each pool is closed: Terminate
/// on every connection, the protocol's goodbye. Bounded by [`CLOSE_TIMEOUT`] in all: a
/// server that does not answer does not hold the exit up.
pub async fn close_all() {
    let pools = std::mem::take(
        &mut *OPENED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    let closing = async {
        for pool in pools {
            while usize::try_from(pool.size()).is_ok_and(|size| pool.num_idle() < size) {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            pool.close().await;
        }
    };
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, closing).await;
}

impl Conn {
    /// The PostgreSQL URL, or an error saying how to give one.
    pub fn database_url(&self) -> Result<&str> {
        self.database_url
            .as_deref()
            .filter(|u| !u.is_empty())
            .context("no PostgreSQL URL: pass --database-url or set DATABASE_URL")
    }

    /// The issuer URL (`--issuer-url` / `PGFENCE_ISSUER_URL`, else the Redis URL), or an
    /// error saying how to give one.
    pub fn issuer_url(&self) -> Result<&str> {
        match self.issuer_url.as_deref().filter(|u| !u.is_empty()) {
            Some(url) => Ok(url),
            None => self.redis_url.as_deref().filter(|u| !u.is_empty()).context(
                "no issuer URL: pass --issuer-url (or --redis-url), or set PGFENCE_ISSUER_URL (or REDIS_URL)",
            ),
        }
    }

    /// The key prefix (`--key-prefix` / `PGFENCE_KEY_PREFIX`), checked; `None` for the
    /// default.
    pub fn key_prefix(&self) -> Result<Option<&str>> {
        match self.key_prefix.as_deref() {
            None => Ok(None),
            Some(prefix) => Ok(Some(
                pgfence::issuer::limits::check_key_prefix(prefix)
                    .context("bad --key-prefix / PGFENCE_KEY_PREFIX")?,
            )),
        }
    }

    /// `--idle-expiry` / `PGFENCE_IDLE_EXPIRY`, checked (`None`: off).
    fn idle_expiry(&self) -> Result<Option<Duration>> {
        self.idle_expiry
            .map(|secs| {
                pgfence::issuer::check_idle_expiry(Duration::from_secs(secs))
                    .context("bad --idle-expiry / PGFENCE_IDLE_EXPIRY")
            })
            .transpose()
    }

    /// A pool of one connection on the configured PostgreSQL: an admin command runs its
    /// sessions one after the other on it, so behind a pooler in session mode it holds one
    /// server connection, never two (with a one-connection server pool a second client
    /// connection would wait for the first forever).
    pub async fn pg(&self) -> Result<PgPool> {
        connect_pg_with(self.database_url()?, 1).await
    }

    /// A pool on the configured PostgreSQL, which must have pgfence's schema (checked in a
    /// [`Session`] of its own).
    pub async fn pg_migrated(&self) -> Result<PgPool> {
        let pool = self.pg().await?;
        self.session_on(&pool).await?.commit().await?;
        Ok(pool)
    }

    /// A [`Session`] on the configured PostgreSQL, which must have pgfence's schema.
    pub async fn session_migrated(&self) -> Result<Session> {
        self.session_on(&self.pg().await?).await
    }

    /// A [`Session`] on `pool`, whose database must have pgfence's schema.
    async fn session_on(&self, pool: &PgPool) -> Result<Session> {
        let mut session = Session::begin(pool).await?;
        require_schema(session.conn()).await?;
        Ok(session)
    }

    /// The configured issuer (Redis, etcd or ZooKeeper, by the URL's scheme), with the key
    /// prefix.
    pub async fn issuer(&self) -> Result<Arc<dyn TokenIssuer>> {
        connect_issuer(
            self.issuer_url()?,
            self.key_prefix()?,
            self.idle_expiry()?,
            None,
        )
        .await
    }

    /// An issuer for taking locks: for Redis, when a PostgreSQL URL is configured, it
    /// recovers a lost counter by itself ([`RedisIssuer::with_floor_source`]): a lease taken on a
    /// missing counter gets a token above the resource's high-water mark. Without a
    /// reachable, migrated database it says so on stderr (once the command's outcome is known)
    /// and issues tokens from Redis alone (safety does not depend on it: Postgres still rejects
    /// old tokens). etcd, ZooKeeper and the PostgreSQL issuer need no floor (their counters
    /// never go backwards).
    pub async fn lock_issuer(&self) -> Result<Arc<dyn TokenIssuer>> {
        let url = self.issuer_url()?;
        let prefix = self.key_prefix()?;
        if issuer_kind(url)? != IssuerKind::Redis {
            return connect_issuer(url, prefix, self.idle_expiry()?, None).await;
        }
        // Standalone, TLS or Sentinel: the same options, one parser (the library's).
        connect_issuer(url, prefix, self.idle_expiry()?, self.floor().await).await
    }

    /// The migrated database to recover a lost Redis counter from, when one is configured;
    /// says on stderr when it is configured but cannot be used.
    async fn floor(&self) -> Option<PgPool> {
        let url = self.database_url().ok()?;
        let floor = async {
            let pool = connect_pg(url).await?;
            self.session_on(&pool).await?.commit().await?;
            anyhow::Ok(pool)
        };
        match floor.await {
            Ok(pool) => Some(pool),
            Err(e) => {
                crate::util::warn_later(format!(
                    "a lost Redis counter cannot be recovered from PostgreSQL ({})",
                    crate::util::one_line(&e)
                ));
                None
            }
        }
    }
}

/// The error of a connection attempt that got no answer within [`CONNECT_TIMEOUT`].
fn no_answer() -> anyhow::Error {
    anyhow!(
        "the server did not answer within {}s",
        CONNECT_TIMEOUT.as_secs()
    )
}

/// A small pool on PostgreSQL at `url` (a `postgres://` URL or a keyword conninfo string,
/// libpq's `sslmode` values, `prefer` by default). One connection is made first, directly, so
/// that a refused or failed connection reports its real cause at once (a pool keeps retrying
/// a refused connection until its timeout and then only says that it timed out).
///
/// With `sslmode=prefer` (the default) against a host that is not loopback, a server that
/// refuses TLS is connected to in plaintext, as libpq does — and said so once on stderr.
pub async fn connect_pg(url: &str) -> Result<PgPool> {
    connect_pg_with(url, 4).await
}

/// [`connect_pg`] with a pool of at most `max` connections.
pub async fn connect_pg_with(url: &str, max: u32) -> Result<PgPool> {
    let context = || format!("cannot connect to PostgreSQL at {}", redact(url));
    let options = pg_options(url).with_context(context)?;
    let probe = tokio::time::timeout(CONNECT_TIMEOUT, PgConnection::connect_with(&options))
        .await
        .map_err(|_| no_answer())
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(context)?;
    let _ = tokio::time::timeout(CLOSE_TIMEOUT, probe.close()).await;
    warn_if_plaintext(&options).await;
    let pool = PgPoolOptions::new()
        .max_connections(max)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect_with(options)
        .await
        .with_context(context)?;
    opened(&pool);
    Ok(pool)
}

/// Connect options from a URL (`postgres://`, `postgresql://`) or a keyword conninfo string
/// (`host=db.internal port=5432 dbname=app user=app sslmode=verify-full`).
pub fn pg_options(url: &str) -> Result<PgConnectOptions> {
    let trimmed = url.trim();
    if IssuerKind::of_url(trimmed).is_ok_and(|k| k == IssuerKind::Postgres) {
        return PgConnectOptions::from_str(trimmed)
            .map_err(|e| anyhow!("{}", crate::util::scrub(&e.to_string())));
    }
    if trimmed.contains("://") || !trimmed.contains('=') {
        bail!(
            "not a PostgreSQL URL: expected postgres://... or a keyword string (host=... dbname=...)"
        );
    }
    conninfo_options(trimmed)
}

/// Parses libpq's keyword/value form: `key=value` pairs separated by spaces, values in single
/// quotes when they hold spaces (`\'` and `\\` escape inside). Unknown keywords are refused.
fn conninfo_options(conninfo: &str) -> Result<PgConnectOptions> {
    let mut options = PgConnectOptions::new_without_pgpass();
    let mut password_seen = false;
    for (key, value) in conninfo_pairs(conninfo)? {
        options = match key.as_str() {
            "host" | "hostaddr" => options.host(&value),
            "port" => options.port(value.parse().map_err(|_| anyhow!("conninfo: port {value:?} is not a port number"))?),
            "dbname" => options.database(&value),
            "user" => options.username(&value),
            "password" => {
                password_seen = true;
                options.password(&value)
            }
            "sslmode" => options.ssl_mode(
                value
                    .parse::<PgSslMode>()
                    .map_err(|_| anyhow!("conninfo: unknown sslmode {value:?} (disable, allow, prefer, require, verify-ca, verify-full)"))?,
            ),
            "sslrootcert" => options.ssl_root_cert(&value),
            "sslcert" => options.ssl_client_cert(&value),
            "sslkey" => options.ssl_client_key(&value),
            "application_name" => options.application_name(&value),
            "options" => options.options(
                value
                    .split_whitespace()
                    .filter_map(|o| o.strip_prefix("-c").map(str::trim).filter(|o| !o.is_empty()).or(Some(o)))
                    .filter_map(|o| o.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect::<Vec<_>>(),
            ),
            "connect_timeout" => options,
            other => bail!(
                "conninfo: keyword {other:?} is not supported here (host, hostaddr, port, dbname, user, password, sslmode, sslrootcert, sslcert, sslkey, application_name, options, connect_timeout); use a postgres:// URL for anything else"
            ),
        };
    }
    if !password_seen
        && let Ok(pw) = std::env::var("PGPASSWORD")
        && !pw.is_empty()
    {
        options = options.password(&pw);
    }
    Ok(options)
}

/// The `key=value` pairs of a conninfo string.
fn conninfo_pairs(s: &str) -> Result<Vec<(String, String)>> {
    let mut pairs = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.peek().is_none() {
            return Ok(pairs);
        }
        let mut key = String::new();
        while let Some(c) = chars.next_if(|c| *c != '=' && !c.is_whitespace()) {
            key.push(c);
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        if chars.next() != Some('=') {
            bail!("conninfo: expected key=value after {key:?}");
        }
        while chars.next_if(|c| c.is_whitespace()).is_some() {}
        let mut value = String::new();
        if chars.next_if_eq(&'\'').is_some() {
            loop {
                match chars.next() {
                    None => bail!("conninfo: unterminated quoted value for {key:?}"),
                    Some('\'') => break,
                    Some('\\') => match chars.next() {
                        Some(c) => value.push(c),
                        None => bail!("conninfo: unterminated quoted value for {key:?}"),
                    },
                    Some(c) => value.push(c),
                }
            }
        } else {
            while let Some(c) = chars.next_if(|c| !c.is_whitespace()) {
                if c == '\\' {
                    if let Some(n) = chars.next() {
                        value.push(n);
                    }
                } else {
                    value.push(c);
                }
            }
        }
        pairs.push((key.to_ascii_lowercase(), value));
    }
}

/// Says once on stderr ([`crate::util::warn_later`]) when `options` would let a non-loopback
/// server take the connection in plaintext: `sslmode=prefer` (libpq's and sqlx's default) and
/// the server answers the TLS request with "no". The probe is the protocol's own first step
/// (an 8-byte SSLRequest and its one-byte answer), made on a connection of its own.
async fn warn_if_plaintext(options: &PgConnectOptions) {
    if !matches!(options.get_ssl_mode(), PgSslMode::Prefer | PgSslMode::Allow) {
        return;
    }
    let host = options.get_host().to_owned();
    if host.starts_with('/') || host.is_empty() || is_loopback(&host) {
        return;
    }
    let port = options.get_port();
    let probe = async {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut stream = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .ok()?;
        // Length 8, request code 80877103 (1234.5679).
        stream
            .write_all(&[0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f])
            .await
            .ok()?;
        let mut answer = [0u8; 1];
        stream.read_exact(&mut answer).await.ok()?;
        Some(answer[0])
    };
    if let Ok(Some(b'N')) = tokio::time::timeout(CONNECT_TIMEOUT, probe).await {
        crate::util::warn_later(format!(
            "PostgreSQL at {host}:{port} refused TLS; connected in plaintext (sslmode=prefer). Set sslmode=verify-full (or require) in the URL to insist on TLS"
        ));
    }
}

/// Whether `host` is this machine: `localhost`, `127.x.x.x`, `::1`.
fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

/// One transaction on one connection of the pool: what every admin command runs in.
///
/// Behind a transaction-mode pooler (PgBouncer) a server connection is this client's only
/// for the length of a transaction, so everything a command sends — its settings
/// (`set_config(..., true)`), its prepared statements, its locks — is inside this transaction,
/// and [`Session::commit`] closes the statements it prepared before it commits. Nothing of the
/// command's is left on the server connection for the pooler's next client.
pub struct Session {
    tx: Transaction<'static, Postgres>,
}

impl Session {
    /// Begins a transaction on a connection of `pool`.
    pub async fn begin(pool: &PgPool) -> Result<Self> {
        Ok(Self {
            tx: pool.begin().await.context("cannot begin a transaction")?,
        })
    }

    /// The transaction's connection.
    pub fn conn(&mut self) -> &mut PgConnection {
        &mut self.tx
    }

    /// Closes every statement the session prepared, then commits.
    pub async fn commit(mut self) -> Result<()> {
        self.tx.clear_cached_statements().await?;
        self.tx.commit().await?;
        Ok(())
    }
}

/// Fails with "run `pgfence migrate`" when the database has no `pgfence` schema.
pub async fn require_schema(conn: &mut PgConnection) -> Result<()> {
    let present: bool =
        sqlx::query_scalar("SELECT pg_catalog.to_regnamespace('pgfence') IS NOT NULL")
            .fetch_one(conn)
            .await
            .context("cannot read the catalog")?;
    if !present {
        bail!("this database has no pgfence schema: run `pgfence migrate` first");
    }
    Ok(())
}

/// The issuer `url` names ([`pgfence::issuer::IssuerKind::of_url`]: the library's table, which
/// [`pgfence::issuer::connect_issuer_with`] dispatches on), for the choices made before connecting.
pub fn issuer_kind(url: &str) -> Result<IssuerKind> {
    Ok(IssuerKind::of_url(url)?)
}

/// The store an issuer kind runs on, for messages.
fn store_name(kind: IssuerKind) -> &'static str {
    match kind {
        IssuerKind::Etcd => "etcd",
        IssuerKind::ZooKeeper => "ZooKeeper",
        IssuerKind::Postgres => "PostgreSQL",
        _ => "Redis",
    }
}

/// Whether `url` names a standalone Redis (not Sentinel, not another store).
pub fn is_plain_redis(url: &str) -> bool {
    IssuerKind::of_url(url).is_ok_and(|k| k == IssuerKind::Redis)
        && !pgfence::issuer::redis::is_sentinel_url(url)
}

/// The issuer `url` names ([`pgfence::issuer::connect_issuer_with`]) with the key `prefix`
/// (`None`: the default), the idle expiry of its per-resource state (`None`: off) and, for
/// Redis, the database to recover a lost counter from; giving up after a few seconds. The
/// PostgreSQL issuer's own pool is one [`close_all`] closes.
pub async fn connect_issuer(
    url: &str,
    prefix: Option<&str>,
    idle: Option<Duration>,
    floor: Option<PgPool>,
) -> Result<Arc<dyn TokenIssuer>> {
    let kind = issuer_kind(url)?;
    let what = store_name(kind);
    let connecting = async {
        if kind == IssuerKind::Postgres {
            let issuer = PgIssuer::connect(url).await?;
            opened(issuer.pool());
            let issuer = match prefix {
                Some(prefix) => issuer.with_key_prefix(prefix)?,
                None => issuer,
            };
            let issuer = match idle {
                Some(idle) => issuer.with_idle_expiry(idle)?,
                None => issuer,
            };
            return Ok(Arc::new(issuer) as Arc<dyn TokenIssuer>);
        }
        let mut options = IssuerOptions::new();
        if let Some(prefix) = prefix {
            options = options.key_prefix(prefix);
        }
        if let Some(idle) = idle {
            options = options.idle_expiry(idle);
        }
        if let Some(pool) = floor {
            options = options.floor_source(pool);
        }
        pgfence::issuer::connect_issuer_with(url, options).await
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, connecting).await {
        Ok(Ok(issuer)) => Ok(issuer),
        // Not a connection problem: say what to do.
        Ok(Err(e @ pgfence::Error::IssuerNotBuilt { feature, .. })) => Err(anyhow!(
            "{e} (for this command: cargo install pgfence-cli --features {feature})"
        )),
        // A URL that did not parse: nothing was tried, and the error names the URL's host.
        Ok(Err(e)) if e.kind() == pgfence::error::ErrorKind::Invalid => Err(e.into()),
        Ok(Err(e)) => Err(anyhow::Error::from(e))
            .with_context(|| format!("cannot connect to {what} at {}", redact(url))),
        Err(_) => {
            Err(no_answer()).with_context(|| format!("cannot connect to {what} at {}", redact(url)))
        }
    }
}

/// An issuer on Redis at `url`, giving up after a few seconds.
pub async fn connect_redis(url: &str) -> Result<RedisIssuer> {
    tokio::time::timeout(CONNECT_TIMEOUT, RedisIssuer::connect(url))
        .await
        .map_err(|_| no_answer())
        .and_then(|r| r.map_err(anyhow::Error::from))
        .with_context(|| format!("cannot connect to Redis at {}", redact(url)))
}

/// Backoff between attempts while waiting: 10 ms doubling to 500 ms, jittered.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// Takes `resource`'s lock, waiting up to `wait` if given; fails if another holder keeps it,
/// saying who and for how long.
///
/// The wait is this loop rather than [`RedisIssuer::acquire_wait`]: that one never sleeps past the
/// holder's remaining TTL, which Redis reports as nothing (PTTL -1) for a lock key without an
/// expiry, and so polls it about every millisecond. Here the backoff only shortens to a
/// positive remaining TTL, and a lock that will never expire is reported.
pub async fn take_lock(
    issuer: &dyn TokenIssuer,
    resource: &Resource,
    ttl: Duration,
    wait: Option<Duration>,
) -> Result<Lease> {
    pgfence::issuer::limits::check_ttl(ttl)?;
    let started = Instant::now();
    let give_up = wait.map(|w| started.checked_add(w).unwrap_or_else(far_future));
    let owner = pgfence::Lease::new_owner_id();
    let mut backoff = FIRST_BACKOFF;
    let mut logged = false;
    loop {
        let retry_in = match issuer.acquire_as(resource, &owner, ttl).await? {
            Ok(lease) => return Ok(lease),
            Err(retry_in) => retry_in,
        };
        let now = Instant::now();
        let Some(give_up) = give_up.filter(|g| now < *g) else {
            return Err(held_error(issuer, resource, wait.map(|_| now - started)).await);
        };
        // No warning line: if the wait ends in failure, the error says the lock has no
        // expiry (an error is one line, never preceded by a warning); `--verbose` shows it now.
        if retry_in.is_zero() && !logged {
            logged = true;
            if let Ok(status) = issuer.status(resource).await
                && status.ttl_ms == Some(-1)
            {
                tracing::info!(
                    target: "pgfence::cli",
                    "the lock on {} has no expiry (its key was set outside pgfence?); it will not free itself",
                    cell(resource.as_str())
                );
            }
        }
        let jittered = backoff.mul_f64(0.5 + rand::random::<f64>() / 2.0);
        let mut nap = jittered.min(give_up - now);
        if !retry_in.is_zero() {
            // The holder's lease ends sooner: try again right then.
            nap = nap.min(retry_in.max(Duration::from_millis(1)));
        }
        tokio::time::sleep(nap).await;
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// About thirty years from now: a deadline that is never reached.
fn far_future() -> Instant {
    Instant::now() + Duration::from_secs(86_400 * 365 * 30)
}

/// "R is locked by another holder: held by OWNER (token N), for another N ms".
async fn held_error(
    issuer: &dyn TokenIssuer,
    resource: &Resource,
    waited: Option<Duration>,
) -> anyhow::Error {
    let name = cell(resource.as_str());
    let mut msg = match waited {
        Some(w) => format!(
            "{name} is locked by another holder (still after waiting {})",
            fmt_duration(w)
        ),
        None => format!("{name} is locked by another holder"),
    };
    if let Ok(status) = issuer.status(resource).await
        && let Some(owner) = &status.owner
    {
        let token = status
            .token
            .map(|t| format!(" (token {t})"))
            .unwrap_or_default();
        let until = match status.ttl_ms {
            Some(ms) if ms >= 0 => format!("for another {ms} ms"),
            _ => "with no expiry (its key was set without a TTL, outside pgfence?); a lock that has no expiry will not free itself".to_owned(),
        };
        msg.push_str(&format!(": held by {}{token}, {until}", cell(owner)));
    }
    anyhow!(msg)
}
