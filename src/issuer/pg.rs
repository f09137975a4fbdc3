//! The PostgreSQL issuer: leases and fence tokens kept in the database the fences live in
//! (migration V7: `pgfence.issuer_lock`, `pgfence.issuer_counter` and the `pgfence.issuer_*`
//! functions).

use crate::error::InvalidInput;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::{AssertSqlSafe, PgPool, Postgres, Row};
use tokio::time::Instant;

use super::idle::{ExpiredState, IssuerState};
use super::keys::{DEFAULT_KEY_PREFIX, check_key_prefix};
use super::lease::{check_owner, ttl_millis};
use super::methods::issuer_methods;
use super::policy::{
    Ask, Attempt, Backend, DEFAULT_CALL_TIMEOUT, PATIENT, Renewal, Resend, limit_refused,
};
use super::token_issuer::IssuerKind;
use super::{Lease, LeaseState, LockStatus, ReleaseOutcome};
use crate::ident::quote_literal;
use crate::{Error, FenceToken, Resource, Result};

/// The URL schemes that select the PostgreSQL issuer in
/// [`connect_issuer`](crate::connect_issuer): `postgres://` and `postgresql://`.
pub(crate) const POSTGRES_SCHEMES: [&str; 2] = ["postgres://", "postgresql://"];

/// Whether `url` names the PostgreSQL issuer (`postgres://` or `postgresql://`, any case).
#[must_use]
pub(crate) fn is_postgres_url(url: &str) -> bool {
    let head = url.get(..13).unwrap_or(url).to_ascii_lowercase();
    POSTGRES_SCHEMES.iter().any(|s| head.starts_with(s))
}

/// Connections [`PgIssuer::connect`] opens at most.
const POOL_SIZE: u32 = 16;

/// Counters (and lock rows) one statement of [`PgIssuer::expire_idle`] deletes at most.
pub const EXPIRE_BATCH: u64 = 10_000;

/// Issues leases and fence tokens from PostgreSQL: no Redis, etcd or ZooKeeper needed.
///
/// A lock is a row of `pgfence.issuer_lock` (owner id, token, expiry by the **database's**
/// clock), a token counter a row of `pgfence.issuer_counter` (one per resource, or per fencing
/// domain). Each operation is **one statement** calling one `SECURITY DEFINER` function
/// (`pgfence.issuer_acquire`, `issuer_release`, `issuer_extend`, `issuer_status`), sent with
/// the simple query protocol: no prepared statement, no advisory lock, no session setting, so
/// it works through a transaction-mode pooler (PgBouncer), and an application role that
/// `pgfence grant` prepared can use it without being able to lower a counter or take a live
/// lock from its holder.
///
/// # Why there is nothing to reseed
///
/// Pointed at the database whose rows it fences (the recommended set-up), the counter and the
/// fences commit in the same WAL: a token can never be behind a fence written after it was
/// issued, and a restart or crash recovery moves both together. So
/// [`TokenIssuer::raise_floor`](crate::TokenIssuer::raise_floor),
/// [`recover_from`](crate::TokenIssuer::recover_from) and
/// [`reseed`](crate::TokenIssuer::reseed) change nothing ([`IssuerKind::can_reseed`](crate::issuer::IssuerKind::can_reseed)
/// is false). A counter that does not exist yet starts above the high-water mark PostgreSQL
/// recorded for the resource (or its domain), so switching a resource from another issuer
/// keeps its checks working. One limit remains: an *asynchronous* standby promoted after the
/// primary died may have lost the newest commits, counter and fences alike, and can then hand
/// out again a token a lease held before the failover; run the database with synchronous
/// replication where zombies across a database failover matter.
///
/// # Waiting
///
/// [`PgIssuer::acquire_wait`] polls with jittered backoff (10 ms doubling to 500 ms, never
/// past the holder's remaining TTL, which the acquire reports). LISTEN/NOTIFY would need a
/// session of its own, which a transaction-mode pooler cannot give.
///
/// ```no_run
/// # async fn f() -> pgfence::Result<()> {
/// use std::time::Duration;
/// let issuer = pgfence::issuer::PgIssuer::connect("postgres://app@127.0.0.1/billing").await?;
/// let resource = pgfence::Resource::new("payments:batch:42")?;
/// if let Some(lease) = issuer.acquire(&resource, Duration::from_secs(30)).await? {
///     // ... fenced writes with lease.token() ...
///     issuer.release(&lease).await?;
/// }
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct PgIssuer {
    pool: PgPool,
    prefix: Arc<str>,
    call_timeout: Duration,
    idle_expiry: Option<Duration>,
    /// When the background expiry last started (shared by clones).
    last_expiry: Arc<std::sync::Mutex<Option<Instant>>>,
}

impl std::fmt::Debug for PgIssuer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PgIssuer")
            .field("key_prefix", &self.prefix)
            .field("call_timeout", &self.call_timeout)
            .field("idle_expiry", &self.idle_expiry)
            .finish_non_exhaustive()
    }
}

impl PgIssuer {
    /// Connects to PostgreSQL at `url` (`postgres://` or `postgresql://`, anything sqlx's
    /// [`PgConnectOptions`] parses) with a small pool of its own. The database needs pgfence's
    /// migrations (V7 or later).
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a URL that does not parse (quoted with its password
    /// hidden); [`Error::Backend`](crate::Error::Backend) when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        if !is_postgres_url(url) {
            return Err(Error::Invalid(InvalidInput::IssuerUrl(
                "the PostgreSQL issuer takes postgres:// or postgresql:// URLs".into(),
            )));
        }
        let options = PgConnectOptions::from_str(url).map_err(|e| {
            Error::Invalid(InvalidInput::IssuerUrl(format!(
                "the PostgreSQL URL {:?} did not parse: {}",
                super::shown_url(url),
                redacted(&e)
            )))
        })?;
        let addr = pg_addr(&options);
        // One connection first, directly: a pool retries a refused connection until its
        // timeout and then says only that it timed out, naming no server.
        match tokio::time::timeout(
            CONNECT_TIMEOUT,
            <sqlx::PgConnection as sqlx::Connection>::connect_with(&options),
        )
        .await
        {
            Err(_) => return Err(unanswered_pg(&addr, None)),
            Ok(Err(sqlx::Error::Io(e))) => return Err(unanswered_pg(&addr, Some(&e))),
            Ok(Err(e)) => return Err(e.into()),
            Ok(Ok(probe)) => {
                let _ = sqlx::Connection::close(probe).await;
            }
        }
        // No ping before each checkout (sqlx's default doubles the round trips): a
        // connection that died since is an I/O error on the statement itself, which every
        // operation here re-sends (owner-safe and idempotent).
        let pool = PgPoolOptions::new()
            .max_connections(POOL_SIZE)
            .test_before_acquire(false)
            .acquire_timeout(CONNECT_TIMEOUT)
            .connect_with(options)
            .await
            .map_err(|e| match e {
                sqlx::Error::PoolTimedOut => unanswered_pg(&addr, None),
                sqlx::Error::Io(e) => unanswered_pg(&addr, Some(&e)),
                e => e.into(),
            })?;
        Ok(Self::new(pool))
    }

    /// An issuer on an existing pool (for example the service's own: the issuer's statements
    /// are short and hold no connection between calls).
    #[must_use]
    pub fn new(pool: PgPool) -> Self {
        Self {
            pool,
            prefix: Arc::from(DEFAULT_KEY_PREFIX),
            call_timeout: DEFAULT_CALL_TIMEOUT,
            idle_expiry: None,
            last_expiry: Arc::default(),
        }
    }

    /// The same issuer with idle state expiring: a resource's counter row that no acquire
    /// used for `idle`, and a lock row that lapsed `idle` ago, are deleted by
    /// [`PgIssuer::expire_idle`], which the issuer runs in the background (at most once per
    /// `idle / 4`, and at least once a minute, while it acquires). Off by default. A deleted
    /// counter's value is kept in one of 4,096 floors per key prefix
    /// (`pgfence.issuer_floor`), and a counter created again starts above its floor and above
    /// PostgreSQL's high-water mark: tokens never go back, so nothing about fencing changes
    /// (the one edge: a re-created counter may start far above the resource's own last token,
    /// by as much as the busiest counter of its bucket issued; see `docs/issuers.md`, "Idle
    /// expiry").
    ///
    /// # Errors
    /// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) outside
    /// [`MIN_IDLE_EXPIRY`](crate::issuer::MIN_IDLE_EXPIRY)`..=`[`MAX_IDLE_EXPIRY`](crate::issuer::MAX_IDLE_EXPIRY).
    pub fn with_idle_expiry(mut self, idle: Duration) -> Result<Self> {
        self.idle_expiry = Some(crate::issuer::check_idle_expiry(idle)?);
        Ok(self)
    }

    /// The idle expiry (see [`PgIssuer::with_idle_expiry`]); `None`: kept for ever.
    #[must_use]
    pub fn idle_expiry(&self) -> Option<Duration> {
        self.idle_expiry
    }

    /// Deletes this key prefix's counters that no acquire used for `idle` (folding each into
    /// its floor, `pgfence.issuer_floor`) and its lock rows that lapsed `idle` ago, in
    /// batches of [`EXPIRE_BATCH`] (each a statement of its own within the call bound) until a
    /// batch finds fewer. Returns how many counters and lock rows it deleted. Safe whenever
    /// it runs: it lowers no token and frees no live lock.
    ///
    /// # Errors
    /// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) for an `idle` outside
    /// [`MIN_IDLE_EXPIRY`](crate::issuer::MIN_IDLE_EXPIRY)`..=`[`MAX_IDLE_EXPIRY`](crate::issuer::MAX_IDLE_EXPIRY);
    /// [`Error::Backend`](crate::Error::Backend).
    pub async fn expire_idle(&self, idle: Duration) -> Result<ExpiredState> {
        let idle = crate::issuer::check_idle_expiry(idle)?;
        let sql = format!(
            "SELECT counters, locks FROM pgfence.issuer_expire_idle({}, {}, {EXPIRE_BATCH})",
            self.prefix_literal()?,
            crate::issuer::idle_millis(Some(idle)),
        );
        let mut total = ExpiredState::default();
        loop {
            let row = tokio::time::timeout(self.call_timeout, self.one_row(&sql))
                .await
                .map_err(|_| <Self as Backend>::no_reply(self.call_timeout))??;
            let counters = u64::try_from(row.try_get::<i64, _>("counters")?).unwrap_or(0);
            let locks = u64::try_from(row.try_get::<i64, _>("locks")?).unwrap_or(0);
            total.counters += counters;
            total.locks += locks;
            crate::metrics::idle_state_expired(counters, locks);
            if counters < EXPIRE_BATCH && locks < EXPIRE_BATCH {
                return Ok(total);
            }
        }
    }

    /// Starts [`PgIssuer::expire_idle`] in the background when idle expiry is on and the last
    /// run started `idle / 4` (at most a minute) ago; a failure is logged, and the next
    /// acquire after the interval tries again.
    fn expire_in_background(&self) {
        let Some(idle) = self.idle_expiry else {
            return;
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let every = (idle / 4).min(Duration::from_secs(60));
        {
            let mut last = self
                .last_expiry
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if last.is_some_and(|at| at.elapsed() < every) {
                return;
            }
            *last = Some(Instant::now());
        }
        let issuer = self.clone();
        runtime.spawn(async move {
            match issuer.expire_idle(idle).await {
                Ok(done) if done.counters > 0 || done.locks > 0 => tracing::info!(
                    target: "pgfence::issuer",
                    key_prefix = &*issuer.prefix,
                    counters = done.counters,
                    locks = done.locks,
                    "expired idle issuer state (counters folded into pgfence.issuer_floor)"
                ),
                Ok(_) => {}
                Err(e) => tracing::warn!(
                    target: "pgfence::issuer",
                    key_prefix = &*issuer.prefix,
                    error = %e,
                    "could not expire idle issuer state; the next acquire tries again"
                ),
            }
        });
    }

    /// The same issuer with another call bound ([`DEFAULT_CALL_TIMEOUT`], 5 s, by default):
    /// an acquire, release, extend or status read returns within `bound`, its re-sends
    /// included, or fails with an I/O timeout ([`Error::Backend`](crate::Error::Backend), retryable). The server
    /// ends a transaction of the issuer's left idle for `bound`, and a statement of it waiting
    /// on a lock or running for `bound` (see the type's docs, "Time bound"). The first attempt
    /// of a call gets at least 100 ms however small `bound` is.
    #[must_use]
    pub fn with_call_timeout(mut self, bound: Duration) -> Self {
        self.call_timeout = bound;
        self
    }

    /// The call bound (see [`PgIssuer::with_call_timeout`]).
    #[must_use]
    pub fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    /// The same issuer with another key prefix: issuers with different prefixes share no lock
    /// and no counter on one database.
    ///
    /// # Errors
    /// [`InvalidInput::KeyPrefix`](crate::error::InvalidInput::KeyPrefix) (see [`check_key_prefix`]).
    pub fn with_key_prefix(mut self, prefix: &str) -> Result<Self> {
        self.prefix = Arc::from(check_key_prefix(prefix)?);
        Ok(self)
    }

    /// The key prefix (`pgfence` by default).
    #[must_use]
    pub fn key_prefix(&self) -> &str {
        &self.prefix
    }

    /// The pool the issuer sends its statements on.
    #[must_use]
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    fn prefix_literal(&self) -> Result<String> {
        quote_literal(&self.prefix)
            .map_err(|_| Error::Invalid(InvalidInput::KeyPrefix("contains a NUL byte".into())))
    }

    /// One statement, simple query protocol (no named prepared statement for a pooler to
    /// lose), one row back, in a transaction of its own that commits only if this call is not
    /// cut off first (see the type's docs, "Time bound"): opened, with the server-side bounds,
    /// in the statement's own message, committed in a second one.
    async fn one_row(&self, sql: &str) -> Result<PgRow> {
        let ms = i32::try_from(self.call_timeout.as_millis())
            .unwrap_or(i32::MAX)
            .max(1);
        let query = format!(
            "BEGIN; SET LOCAL idle_in_transaction_session_timeout = {ms}; \
             SET LOCAL lock_timeout = {ms}; SET LOCAL statement_timeout = {ms}; {sql}"
        );
        // Nothing is sent before the connection is in the guard: from then on, a drop before
        // the COMMIT's reply closes it.
        let mut open = Uncommitted(Some(self.pool.acquire().await?));
        let conn = open.conn()?;
        let row = sqlx::raw_sql(AssertSqlSafe(query))
            .fetch_one(&mut **conn)
            .await?;
        sqlx::raw_sql(AssertSqlSafe("COMMIT".to_owned()))
            .execute(&mut **conn)
            .await?;
        open.committed();
        Ok(row)
    }

    async fn code(&self, sql: &str) -> Result<i64> {
        let code: i32 = self.one_row(sql).await?.try_get("code")?;
        Ok(i64::from(code))
    }
}

issuer_methods! {
    impl[] PgIssuer {
        error: "[`Error::Backend`](crate::Error::Backend)",
        acquire: {}
        acquire_as: {
            /// `retry_in` is the holder's remaining TTL by the database's clock. Owner ids are at
            /// most 256 bytes here, without NUL bytes ([`InvalidInput::Owner`](crate::error::InvalidInput::Owner) otherwise).
        }
        acquire_wait: {
            ///
            /// See the type's docs, "Waiting".
        }
        release: {
            /// The counter is left alone.
        }
        extend: {
            /// "Now" is the database's.
        }
        status: {}
    }
}

impl Backend for PgIssuer {
    const KIND: IssuerKind = IssuerKind::Postgres;
    const RESEND: Resend = PATIENT;

    fn key_prefix(&self) -> &str {
        &self.prefix
    }

    fn call_timeout(&self) -> Duration {
        self.call_timeout
    }

    fn idle_expiry(&self) -> Option<Duration> {
        self.idle_expiry
    }

    /// `pgfence.issuer_state`: counters, idle counters, lock rows, floors of the prefix.
    async fn state_once(&self) -> Result<Option<IssuerState>> {
        let sql = format!(
            "SELECT counters, idle, locks, floors FROM pgfence.issuer_state({})",
            self.prefix_literal()?
        );
        let row = self.one_row(&sql).await?;
        let get = |name: &str| -> Result<u64> {
            Ok(u64::try_from(row.try_get::<i64, _>(name)?).unwrap_or(0))
        };
        let counters = get("counters")?;
        Ok(Some(IssuerState {
            counters,
            expiring: Some(if self.idle_expiry.is_some() {
                counters
            } else {
                0
            }),
            locks: get("locks")?,
            idle: get("idle")?,
            other: 0,
            floors: get("floors")?,
            idle_expiry: self.idle_expiry,
        }))
    }

    fn no_reply(after: Duration) -> Error {
        Error::database(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("no reply from PostgreSQL within {after:?}"),
        )))
    }

    /// One statement: `pgfence.issuer_acquire` takes a free or lapsed lock, or renews the
    /// same owner's, and reports the holder's remaining TTL otherwise.
    async fn try_acquire(&self, ask: &Ask<'_>) -> Result<Attempt> {
        self.expire_in_background();
        let sql = format!(
            "SELECT acquired, token, ttl_ms FROM pgfence.issuer_acquire({}, {}, {}, {})",
            self.prefix_literal()?,
            resource_literal(ask.resource)?,
            owner_literal(ask.owner)?,
            ttl_millis(ask.ttl)?,
        );
        let sent_at = Instant::now();
        let row = self
            .one_row(&sql)
            .await
            .map_err(|e| token_limit(e, ask.resource))?;
        if !row.try_get::<bool, _>("acquired")? {
            let ms: i64 = row.try_get::<Option<i64>, _>("ttl_ms")?.unwrap_or(0);
            return Ok(Attempt::Busy(Duration::from_millis(
                u64::try_from(ms).unwrap_or(0),
            )));
        }
        let token: i64 = row.try_get::<Option<i64>, _>("token")?.ok_or_else(|| {
            Error::Invalid(InvalidInput::Token(
                "NULL from pgfence.issuer_acquire".into(),
            ))
        })?;
        Ok(Attempt::Granted(
            ask.lease(FenceToken::new(token)?, sent_at),
        ))
    }

    async fn release_once(&self, lease: &Lease) -> Result<ReleaseOutcome> {
        let sql = format!(
            "SELECT pgfence.issuer_release({}, {}, {}, {}) AS code",
            self.prefix_literal()?,
            resource_literal(&lease.resource)?,
            owner_literal(&lease.owner)?,
            lease.token.get(),
        );
        Ok(ReleaseOutcome::from_reply(self.code(&sql).await?))
    }

    async fn extend_once(&self, lease: &Lease, ttl: Duration) -> Result<Renewal> {
        let sql = format!(
            "SELECT pgfence.issuer_extend({}, {}, {}, {}, {}) AS code",
            self.prefix_literal()?,
            resource_literal(&lease.resource)?,
            owner_literal(&lease.owner)?,
            lease.token.get(),
            ttl_millis(ttl)?,
        );
        let sent_at = Instant::now();
        Ok(Renewal::of(
            LeaseState::from_reply(self.code(&sql).await?),
            sent_at + ttl,
        ))
    }

    async fn status_once(&self, resource: &Resource) -> Result<LockStatus> {
        let sql = format!(
            "SELECT owner, token, ttl_ms, counter FROM pgfence.issuer_status({}, {})",
            self.prefix_literal()?,
            resource_literal(resource)?,
        );
        let row = self.one_row(&sql).await?;
        let owner: Option<String> = row.try_get("owner")?;
        Ok(LockStatus {
            resource: resource.to_string(),
            token: row.try_get("token")?,
            ttl_ms: if owner.is_some() {
                row.try_get("ttl_ms")?
            } else {
                None
            },
            owner,
            counter: row.try_get("counter")?,
        })
    }
}

/// A pooled connection in the middle of one of the issuer's transactions. Dropped before
/// [`Uncommitted::committed`] (an error, the call bound, a caller that gave up), it is taken out
/// of the pool and closed, never reused: the server rolls back whatever of the transaction it
/// has run or will still receive, since the `COMMIT` can no longer come.
struct Uncommitted(Option<PoolConnection<Postgres>>);

impl Uncommitted {
    fn conn(&mut self) -> Result<&mut PoolConnection<Postgres>> {
        self.0
            .as_mut()
            .ok_or(Error::database(sqlx::Error::PoolClosed))
    }

    /// The transaction committed: the connection goes back to the pool.
    fn committed(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Uncommitted {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            // Detached, then dropped: its socket closes now, with no message sent on it.
            drop(conn.detach());
        }
    }
}

/// The acquire's refusal to pass the token limit (SQLSTATE 22003) as [`InvalidInput::Token`](crate::error::InvalidInput::Token).
/// `pgfence.issuer_acquire` raises it after its writes, in the one statement it is, so they
/// roll back with it: the lock stays free and the counter as it was.
fn token_limit(e: Error, resource: &Resource) -> Error {
    if let Error::Backend(b) = &e
        && let Some(sqlx::Error::Database(db)) = b.as_sqlx()
        && db.code().as_deref() == Some("22003")
    {
        // DETAIL: `counter=<counter id> token=<the token it would have issued>`.
        let detail = db
            .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
            .and_then(|pg| pg.detail())
            .unwrap_or_default();
        let at = detail
            .rsplit_once("token=")
            .and_then(|(_, t)| t.trim().parse::<i64>().ok())
            .map_or_else(String::new, |next| format!(" (at {})", next - 1));
        return limit_refused(
            resource,
            &format!("its token counter in pgfence.issuer_counter{at}"),
            "if it was raised by mistake, the schema's owner sets it back to PostgreSQL's high-water mark (UPDATE pgfence.issuer_counter)",
            false,
        );
    }
    e
}

fn resource_literal(resource: &Resource) -> Result<String> {
    quote_literal(resource.as_str())
        .map_err(|_| Error::Invalid(InvalidInput::Resource("contains a NUL byte".into())))
}

fn owner_literal(owner: &str) -> Result<String> {
    check_owner(owner)?;
    if owner.len() > 256 {
        return Err(Error::Invalid(InvalidInput::Owner(format!(
            "{} bytes long, at most 256 allowed",
            owner.len()
        ))));
    }
    quote_literal(owner)
        .map_err(|_| Error::Invalid(InvalidInput::Owner("contains a NUL byte".into())))
}

/// How long connecting may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `host:port` (or the socket directory) of `options`, for messages.
fn pg_addr(options: &PgConnectOptions) -> String {
    let host = options.get_host();
    if host.starts_with('/') {
        format!("{host} (socket, port {})", options.get_port())
    } else if host.contains(':') {
        format!("[{host}]:{}", options.get_port())
    } else {
        format!("{host}:{}", options.get_port())
    }
}

/// A server that did not answer (refused, unreachable, timed out), named with how it failed
/// ([`super::unanswered`]: `PostgreSQL at HOST:PORT refused the connection`, `... did not
/// answer within 5s`), an I/O error (so still retryable).
fn unanswered_pg(addr: &str, cause: Option<&std::io::Error>) -> Error {
    Error::database(sqlx::Error::Io(super::unanswered(
        "PostgreSQL",
        addr,
        CONNECT_TIMEOUT,
        cause,
    )))
}

/// A URL parse error's text without the URL (which may hold a password).
fn redacted(e: &sqlx::Error) -> String {
    match e {
        sqlx::Error::Configuration(inner) => inner.to_string(),
        _ => "invalid connection URL".to_owned(),
    }
    .chars()
    .take(200)
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schemes() {
        assert!(is_postgres_url("postgres://h/db"));
        assert!(is_postgres_url("PostgreSQL://h/db"));
        assert!(!is_postgres_url("redis://h"));
        assert!(!is_postgres_url("postgres:/h"));
    }

    #[test]
    fn literals_quote_hostile_text() {
        let r = Resource::new(r"a'b\c").unwrap();
        assert_eq!(resource_literal(&r).unwrap(), r"E'a''b\\c'");
        assert!(matches!(
            owner_literal("a:b"),
            Err(Error::Invalid(InvalidInput::Owner(_)))
        ));
        assert!(matches!(
            owner_literal("a\0b"),
            Err(Error::Invalid(InvalidInput::Owner(_)))
        ));
        assert!(matches!(
            owner_literal(&"x".repeat(257)),
            Err(Error::Invalid(InvalidInput::Owner(_)))
        ));
    }
}
