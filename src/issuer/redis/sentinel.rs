//! Redis Sentinel: `redis+sentinel://` URLs and connections that follow the master through a
//! failover.
//!
//! [`SentinelConnections`] asks the sentinels for the master's address
//! (`SENTINEL get-master-addr-by-name`), checks with `ROLE` that the node it reaches is a
//! master, and sends every command there. When the master goes away (a dropped or refused
//! connection, a timeout) or stops being the master (`READONLY`, `MASTERDOWN`, `LOADING`), the
//! connections are dropped and the next command asks the sentinels again. A command that finds
//! no master waits up to [`SentinelConnections::failover_wait`] for the sentinels to promote
//! one — nothing has been sent yet, so the wait is safe for every command — and then fails with
//! an I/O error. Every failure a failover causes is therefore an I/O error, which
//! [`Error::is_retryable`](crate::Error::is_retryable) reports as retryable and the issuer's own
//! retries (acquire with the same owner, extend, release, status, raise) re-send on the new
//! master. A command that was in flight when the master died is never re-sent here.
//!
//! `rediss+sentinel://` is the same over TLS, to the sentinels and to the master alike (Redis's
//! `tls-port` on the sentinels, with `tls-replication yes` so that they reach the master over
//! TLS too), with one CA and one client certificate for both: see [`SentinelUrl`].
//!
//! A failover can lose the last `INCR`s (replication is asynchronous): the promoted replica's
//! counter may be behind. Postgres still rejects the old tokens; see docs/operations.md, "After a Redis
//! failover", for getting liveness back.

use crate::error::InvalidInput;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::{
    AsyncConnectionConfig, ConnectionAddr, ErrorKind, IntoConnectionInfo, RedisConnectionInfo,
    RedisError, RedisResult, ServerErrorKind, Value,
};
use tokio::time::Instant;

use super::acl::{SENTINEL_REFUSED, is_acl_denial};
use super::{RedisIssuer, default_connections};
use crate::tls::{TlsFiles, TlsParams, percent_decode};
use crate::{Error, Result};

/// The URL scheme that selects Redis Sentinel:
/// `redis+sentinel://[user:pass@]host1:port1[,host2:port2...]/<master-name>[/db]`.
pub const SENTINEL_SCHEME: &str = "redis+sentinel";

/// The URL scheme that selects Redis Sentinel over TLS, to the sentinels and to the master
/// (feature `tls`):
/// `rediss+sentinel://[user:pass@]host1:port1[,...]/<master-name>[/db][?cacert=..&cert=..&key=..]`.
pub const SENTINEL_TLS_SCHEME: &str = "rediss+sentinel";

/// The port a sentinel address without one gets.
pub const DEFAULT_SENTINEL_PORT: u16 = 26379;

/// How long a command waits for the sentinels to name a reachable master, by default.
pub const DEFAULT_FAILOVER_WAIT: Duration = Duration::from_secs(5);

/// How long one sentinel, or one candidate master, may take to answer.
const NODE_TIMEOUT: Duration = Duration::from_millis(500);
/// Pause between two rounds of asking the sentinels while no master is reachable.
const POLL: Duration = Duration::from_millis(50);
/// Response timeout of the connections to the master (as [`super::RedisConnections`]).
const RESPONSE_TIMEOUT: Duration = Duration::from_secs(5);

/// Whether `url` is a `redis+sentinel://` or `rediss+sentinel://` (TLS) URL.
#[must_use]
pub fn is_sentinel_url(url: &str) -> bool {
    scheme_len(url).is_some()
}

/// The length of `url`'s Sentinel scheme with its `://`, and whether it is the TLS one.
fn scheme_len(url: &str) -> Option<(usize, bool)> {
    [(SENTINEL_SCHEME, false), (SENTINEL_TLS_SCHEME, true)]
        .into_iter()
        .find(|(scheme, _)| {
            url.get(..scheme.len() + 3).is_some_and(|s| {
                s[..scheme.len()].eq_ignore_ascii_case(scheme) && &s[scheme.len()..] == "://"
            })
        })
        .map(|(scheme, tls)| (scheme.len() + 3, tls))
}

/// A parsed `redis+sentinel://` URL.
///
/// `redis+sentinel://[user:pass@]host1:port1[,host2:port2...]/<master-name>[/db]`: the
/// sentinels to ask (port 26379 when omitted; IPv6 in brackets), the name they monitor the
/// master under, and the database number (0 when omitted). The user name and password (percent
/// encoded) are the master's. Sentinels that require a password of their own take it from the
/// query parameters `sentinel_username` and `sentinel_password`.
///
/// `rediss+sentinel://...` (feature `tls`) connects over TLS to the sentinels and to the
/// master, verifying their certificates against the system trust store or the CA file of the
/// query parameter `cacert=PATH`, and presenting the client certificate of `cert=PATH` and
/// `key=PATH` when given (the same to both). The sentinels must listen on TLS (`tls-port`) and
/// announce the master they reach over TLS (`tls-replication yes`). A mix (plaintext sentinels,
/// a TLS master) is not supported. On `redis+sentinel://`, `cacert`, `cert` and `key` are
/// refused.
#[derive(Clone, PartialEq, Eq)]
pub struct SentinelUrl {
    /// The sentinels, in the order they are asked.
    pub sentinels: Vec<(String, u16)>,
    /// The name the sentinels monitor the master under.
    pub master_name: String,
    /// The database number on the master.
    pub db: i64,
    /// User name on the master (ACL).
    pub username: Option<String>,
    /// Password on the master.
    pub password: Option<String>,
    /// User name on the sentinels.
    pub sentinel_username: Option<String>,
    /// Password on the sentinels.
    pub sentinel_password: Option<String>,
    /// TLS to the sentinels and to the master (`rediss+sentinel://`).
    pub tls: bool,
    /// `cacert=`: the CA certificates (PEM) to verify the sentinels and the master with,
    /// instead of the system trust store.
    pub cacert: Option<PathBuf>,
    /// `cert=`: the client certificate chain (PEM) to present.
    pub cert: Option<PathBuf>,
    /// `key=`: the client certificate's private key (PEM).
    pub key: Option<PathBuf>,
}

impl std::fmt::Debug for SentinelUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelUrl")
            .field("sentinels", &self.sentinels)
            .field("master_name", &self.master_name)
            .field("db", &self.db)
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("sentinel_username", &self.sentinel_username)
            .field(
                "sentinel_password",
                &self.sentinel_password.as_ref().map(|_| "***"),
            )
            .field("tls", &self.tls)
            .field("cacert", &self.cacert)
            .field("cert", &self.cert)
            .field("key", &self.key)
            .finish()
    }
}

impl std::fmt::Display for SentinelUrl {
    /// The URL without passwords (and without the TLS files).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let scheme = if self.tls {
            SENTINEL_TLS_SCHEME
        } else {
            SENTINEL_SCHEME
        };
        write!(f, "{scheme}://")?;
        if self.username.is_some() || self.password.is_some() {
            write!(f, "{}", self.username.as_deref().unwrap_or(""))?;
            if self.password.is_some() {
                write!(f, ":***")?;
            }
            write!(f, "@")?;
        }
        let hosts: Vec<String> = self
            .sentinels
            .iter()
            .map(|(h, p)| host_port(h, *p))
            .collect();
        write!(f, "{}/{}", hosts.join(","), self.master_name)?;
        if self.db != 0 {
            write!(f, "/{}", self.db)?;
        }
        Ok(())
    }
}

fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Never echoes the URL itself: it may carry a password.
fn invalid(why: &str) -> Error {
    Error::Invalid(InvalidInput::IssuerUrl(format!(
        "redis+sentinel URL: {why} (expected {SENTINEL_SCHEME}:// or {SENTINEL_TLS_SCHEME}://[user:pass@]host1:port1[,host2:port2...]/<master-name>[/db])"
    )))
}

impl SentinelUrl {
    /// Parses a `redis+sentinel://` or `rediss+sentinel://` URL.
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for another scheme, no sentinel, a bad port, no master
    /// name, or a database that is not a non-negative number;
    /// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) for TLS parameters on `redis+sentinel://`, or `cert` without
    /// `key`.
    pub fn parse(url: &str) -> Result<Self> {
        let Some((scheme_len, tls)) = scheme_len(url) else {
            return Err(invalid(
                "the scheme is not redis+sentinel or rediss+sentinel",
            ));
        };
        let (url, tls_params) = TlsParams::split(url)?;
        if !tls {
            tls_params.refuse_on_plain("redis+sentinel://", "rediss+sentinel://")?;
        }
        let rest = &url[scheme_len..];
        let (rest, query) = match rest.split_once('?') {
            Some((r, q)) => (r, Some(q)),
            None => (rest, None),
        };
        let (authority, path) = rest.split_once('/').unwrap_or((rest, ""));
        let (userinfo, hosts) = match authority.rsplit_once('@') {
            Some((u, h)) => (Some(u), h),
            None => (None, authority),
        };
        let (mut username, mut password) = (None, None);
        if let Some(userinfo) = userinfo {
            let (user, pass) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            username = Some(percent_decode(user).ok_or_else(|| invalid("bad user name"))?)
                .filter(|u| !u.is_empty());
            password = pass
                .map(|p| percent_decode(p).ok_or_else(|| invalid("bad password")))
                .transpose()?;
        }
        let mut sentinels = Vec::new();
        for host in hosts.split(',').filter(|h| !h.is_empty()) {
            sentinels.push(parse_host(host).ok_or_else(|| invalid("bad sentinel address"))?);
        }
        if sentinels.is_empty() {
            return Err(invalid("no sentinel address"));
        }
        let mut segments = path.split('/');
        let master_name = segments
            .next()
            .map(percent_decode)
            .unwrap_or_default()
            .ok_or_else(|| invalid("bad master name"))?;
        if master_name.is_empty() {
            return Err(invalid("no master name"));
        }
        let db = match segments.next() {
            None | Some("") => 0,
            Some(db) => db
                .parse::<i64>()
                .ok()
                .filter(|db| *db >= 0)
                .ok_or_else(|| invalid("the database is not a non-negative number"))?,
        };
        if segments.any(|s| !s.is_empty()) {
            return Err(invalid("unexpected path after the database"));
        }
        let (mut sentinel_username, mut sentinel_password) = (None, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode(value).ok_or_else(|| invalid("bad query value"))?;
            match key {
                "sentinel_username" => sentinel_username = Some(value),
                "sentinel_password" => sentinel_password = Some(value),
                _ => return Err(invalid("unknown query parameter")),
            }
        }
        Ok(Self {
            sentinels,
            master_name,
            db,
            username,
            password,
            sentinel_username,
            sentinel_password,
            tls,
            cacert: tls_params.cacert,
            cert: tls_params.cert,
            key: tls_params.key,
        })
    }

    fn addr(&self, host: &str, port: u16) -> ConnectionAddr {
        if self.tls {
            ConnectionAddr::TcpTls {
                host: host.to_owned(),
                port,
                insecure: false,
                tls_params: None,
            }
        } else {
            ConnectionAddr::Tcp(host.to_owned(), port)
        }
    }

    fn sentinel_info(&self, host: &str, port: u16) -> RedisResult<redis::ConnectionInfo> {
        let mut settings = RedisConnectionInfo::default();
        if let Some(user) = &self.sentinel_username {
            settings = settings.set_username(user);
        }
        if let Some(pass) = &self.sentinel_password {
            settings = settings.set_password(pass);
        }
        Ok(self
            .addr(host, port)
            .into_connection_info()?
            .set_redis_settings(settings))
    }

    fn master_info(&self, host: &str, port: u16) -> RedisResult<redis::ConnectionInfo> {
        let mut settings = RedisConnectionInfo::default().set_db(self.db);
        if let Some(user) = &self.username {
            settings = settings.set_username(user);
        }
        if let Some(pass) = &self.password {
            settings = settings.set_password(pass);
        }
        Ok(self
            .addr(host, port)
            .into_connection_info()?
            .set_redis_settings(settings))
    }
}

fn parse_host(host: &str) -> Option<(String, u16)> {
    let (name, port) = if let Some(v6) = host.strip_prefix('[') {
        let (name, after) = v6.split_once(']')?;
        match after {
            "" => (name, None),
            p => (name, Some(p.strip_prefix(':')?)),
        }
    } else {
        match host.rsplit_once(':') {
            Some((name, port)) => (name, Some(port)),
            None => (host, None),
        }
    };
    if name.is_empty() {
        return None;
    }
    let port = match port {
        None => DEFAULT_SENTINEL_PORT,
        Some(p) => p.parse().ok().filter(|p| *p != 0)?,
    };
    Some((name.to_owned(), port))
}

/// Connections to the master a set of Redis Sentinels names, re-resolved after a failover.
///
/// Holds `count` multiplexed connections to the current master and sends each command on the
/// next one. The master is the address the sentinels give
/// (`SENTINEL get-master-addr-by-name`, each sentinel asked in turn with a 500 ms timeout) once
/// `ROLE` there says `master`.
///
/// When the master goes away (a dropped or refused connection, a timeout) or stops being the
/// master (`READONLY`, `MASTERDOWN`, `LOADING`), the connections are dropped and the next
/// command asks the sentinels again. A command that finds no master waits up to
/// [`SentinelConnections::failover_wait`] for the sentinels to promote one (nothing has been
/// sent yet, so waiting is safe for every command), then fails with an I/O error. Every
/// failure a failover causes is an I/O error: [`Error::is_retryable`](crate::Error::is_retryable)
/// says so, and the issuer's own retries (acquire with the same owner id, extend, release,
/// status, raise) re-send on the new master. A command in flight when the master died is never
/// re-sent by the connections themselves.
#[derive(Clone)]
pub struct SentinelConnections {
    shared: Arc<Shared>,
}

struct Shared {
    url: SentinelUrl,
    /// The TLS files of a `rediss+sentinel://` URL, read when opening (`None`: plaintext).
    #[cfg_attr(
        not(feature = "tls"),
        allow(dead_code, reason = "no TLS without the feature")
    )]
    tls: Option<TlsFiles>,
    count: usize,
    failover_wait: Duration,
    current: Mutex<Current>,
    /// One resolution at a time; the others wait for its result.
    resolving: tokio::sync::Mutex<()>,
    next: AtomicUsize,
    /// How many times a master was connected to (the first time included).
    resolutions: AtomicU64,
}

#[derive(Default)]
struct Current {
    /// Bumped whenever the master's connections are dropped or replaced.
    generation: u64,
    master: Option<Master>,
    /// Index in `url.sentinels` of the sentinel that answered last: asked first next time.
    preferred: usize,
}

#[derive(Clone)]
struct Master {
    addr: String,
    conns: Arc<[MultiplexedConnection]>,
}

impl std::fmt::Debug for SentinelConnections {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SentinelConnections")
            .field("url", &self.shared.url.to_string())
            .field("connections", &self.shared.count)
            .field("master", &self.master_addr())
            .finish_non_exhaustive()
    }
}

impl SentinelConnections {
    /// Parses `url` (`redis+sentinel://...` or `rediss+sentinel://...`, see [`SentinelUrl`]),
    /// asks the sentinels for the master and opens [`default_connections`] connections to it.
    ///
    /// # Errors
    /// [`InvalidInput::IssuerUrl`](crate::error::InvalidInput::IssuerUrl) for a malformed URL; [`Error::Backend`](crate::Error::Backend) when no sentinel
    /// names a reachable master
    /// within [`DEFAULT_FAILOVER_WAIT`]; [`Error::RedisPermission`] at once when a sentinel or
    /// the master refuses the issuer's user (the rule it names is for the default key prefix);
    /// [`InvalidInput::Tls`](crate::error::InvalidInput::Tls) / [`InvalidInput::TlsFile`](crate::error::InvalidInput::TlsFile) for the TLS parameters;
    /// [`Error::IssuerNotBuilt`] for `rediss+sentinel://` without the `tls` feature.
    pub async fn open(url: &str) -> Result<Self> {
        Self::open_with(url, default_connections(), DEFAULT_FAILOVER_WAIT).await
    }

    /// Like [`SentinelConnections::open`] with `count` connections, and commands waiting up to
    /// `failover_wait` for a master while none is reachable.
    ///
    /// # Errors
    /// As [`SentinelConnections::open`].
    pub async fn open_with(
        url: &str,
        count: NonZeroUsize,
        failover_wait: Duration,
    ) -> Result<Self> {
        let url = SentinelUrl::parse(url)?;
        let tls = if url.tls { Some(open_tls(&url)?) } else { None };
        let this = Self {
            shared: Arc::new(Shared {
                url,
                tls,
                count: count.get(),
                failover_wait,
                current: Mutex::default(),
                resolving: tokio::sync::Mutex::new(()),
                next: AtomicUsize::new(0),
                resolutions: AtomicU64::new(0),
            }),
        };
        this.connection().await.map_err(super::acl::connect_error)?;
        Ok(this)
    }

    /// The URL these connections were opened with.
    #[must_use]
    pub fn url(&self) -> &SentinelUrl {
        &self.shared.url
    }

    /// How long a command waits for the sentinels to name a reachable master.
    #[must_use]
    pub fn failover_wait(&self) -> Duration {
        self.shared.failover_wait
    }

    /// `host:port` of the master the connections are open to now (`None` between a lost
    /// master and the next command).
    #[must_use]
    pub fn master_addr(&self) -> Option<String> {
        self.lock().master.as_ref().map(|m| m.addr.clone())
    }

    /// How many times a master was (re)connected to, the first connection included: `2` after
    /// one failover was followed.
    #[must_use]
    pub fn resolutions(&self) -> u64 {
        self.shared.resolutions.load(Ordering::Relaxed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Current> {
        self.shared
            .current
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Each connection to the current master (none while there is none): a command sent on
    /// every one runs, on each, after whatever that one carried before.
    pub(super) fn lanes(&self) -> Vec<MultiplexedConnection> {
        self.lock()
            .master
            .as_ref()
            .map(|m| m.conns.to_vec())
            .unwrap_or_default()
    }

    fn current(&self) -> Option<(u64, String, MultiplexedConnection)> {
        let current = self.lock();
        let master = current.master.as_ref()?;
        let i = self.shared.next.fetch_add(1, Ordering::Relaxed) % master.conns.len();
        Some((
            current.generation,
            master.addr.clone(),
            master.conns[i].clone(),
        ))
    }

    /// Drops the master's connections if they are still those of `generation`.
    fn forget(&self, generation: u64, why: &RedisError) {
        let mut current = self.lock();
        if current.generation == generation && current.master.is_some() {
            let addr = current.master.take().map(|m| m.addr).unwrap_or_default();
            current.generation += 1;
            tracing::info!(
                target: "pgfence::issuer",
                master = addr,
                name = self.shared.url.master_name,
                error = %why,
                "Redis master lost; asking the sentinels again"
            );
        }
    }

    /// A connection to the current master, asking the sentinels (and waiting up to
    /// `failover_wait` for them to name a reachable master) when there is none.
    async fn connection(&self) -> RedisResult<(u64, String, MultiplexedConnection)> {
        if let Some(found) = self.current() {
            return Ok(found);
        }
        let give_up = Instant::now() + self.shared.failover_wait;
        let Ok(_one_at_a_time) =
            tokio::time::timeout_at(give_up, self.shared.resolving.lock()).await
        else {
            return Err(self.no_master(None));
        };
        loop {
            if let Some(found) = self.current() {
                return Ok(found);
            }
            match self.resolve().await {
                Ok((preferred, master)) => {
                    let mut current = self.lock();
                    current.generation += 1;
                    current.preferred = preferred;
                    tracing::info!(
                        target: "pgfence::issuer",
                        master = master.addr,
                        name = self.shared.url.master_name,
                        "connected to the Redis master the sentinels name"
                    );
                    current.master = Some(master);
                    self.shared.resolutions.fetch_add(1, Ordering::Relaxed);
                }
                // A refused user stays refused: say so now rather than after the wait.
                Err(e) if is_acl_denial(&e) => return Err(e),
                Err(e) => {
                    if Instant::now() + POLL >= give_up {
                        return Err(self.no_master(Some(&e)));
                    }
                    tokio::time::sleep(POLL).await;
                }
            }
        }
    }

    fn no_master(&self, last: Option<&RedisError>) -> RedisError {
        let url = &self.shared.url;
        let hosts: Vec<String> = url
            .sentinels
            .iter()
            .map(|(h, p)| host_port(h, *p))
            .collect();
        let mut msg = format!(
            "no reachable Redis master named {:?} through the sentinels {} within {:?}",
            url.master_name,
            hosts.join(","),
            self.shared.failover_wait
        );
        if let Some(e) = last {
            msg.push_str(&format!(" (last: {e})"));
        }
        // An I/O error: a failover in progress is retryable.
        RedisError::from(std::io::Error::new(std::io::ErrorKind::NotConnected, msg))
    }

    /// Asks each sentinel in turn (the one that answered last first) for the master's address
    /// and connects to the first address whose node says it is a master.
    async fn resolve(&self) -> RedisResult<(usize, Master)> {
        let result = self.resolve_round().await;
        if let Err((Some(answered), _)) = &result {
            // Next round, skip the sentinels that did not answer this time.
            self.lock().preferred = *answered;
        }
        result.map_err(|(_, e)| e)
    }

    async fn resolve_round(
        &self,
    ) -> std::result::Result<(usize, Master), (Option<usize>, RedisError)> {
        let url = &self.shared.url;
        let n = url.sentinels.len();
        let first = self.lock().preferred % n;
        let mut last: Option<RedisError> = None;
        let mut answered = None;
        for k in 0..n {
            let i = (first + k) % n;
            let (host, port) = &url.sentinels[i];
            let asked = tokio::time::timeout(NODE_TIMEOUT, self.ask(host, *port)).await;
            if matches!(asked, Ok(Ok(_))) {
                answered.get_or_insert(i);
            }
            let (mhost, mport) = match asked {
                Ok(Ok(Some(addr))) => addr,
                Ok(Ok(None)) => {
                    last = Some(RedisError::from((
                        ErrorKind::MasterNameNotFoundBySentinel,
                        "the sentinel does not monitor this master",
                        format!("{} at {}", url.master_name, host_port(host, *port)),
                    )));
                    continue;
                }
                Ok(Err(e)) => {
                    last = Some(e);
                    continue;
                }
                Err(_) => {
                    last = Some(timeout_error("sentinel", host, *port));
                    continue;
                }
            };
            match tokio::time::timeout(NODE_TIMEOUT * 2, self.open_master(&mhost, mport)).await {
                Ok(Ok(master)) => return Ok((i, master)),
                Ok(Err(e)) => last = Some(e),
                Err(_) => last = Some(timeout_error("master", &mhost, mport)),
            }
        }
        Err((
            answered,
            last.unwrap_or_else(|| RedisError::from((ErrorKind::Client, "no sentinel"))),
        ))
    }

    /// A client for `info`, over TLS with the URL's files for `rediss+sentinel://`.
    fn client(&self, info: redis::ConnectionInfo) -> RedisResult<redis::Client> {
        #[cfg(feature = "tls")]
        if let Some(files) = &self.shared.tls
            && (files.ca.is_some() || files.identity.is_some())
        {
            return redis::Client::build_with_tls(info, crate::tls::redis_certs(files));
        }
        redis::Client::open(info)
    }

    async fn ask(&self, host: &str, port: u16) -> RedisResult<Option<(String, u16)>> {
        let client = self.client(self.shared.url.sentinel_info(host, port)?)?;
        let mut conn = client
            .get_multiplexed_async_connection_with_config(&config(NODE_TIMEOUT))
            .await?;
        redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(&self.shared.url.master_name)
            .query_async(&mut conn)
            .await
            .map_err(|e| {
                if is_acl_denial(&e) {
                    // Marked, so that the error quotes the sentinels' rule, not the master's.
                    RedisError::from((
                        ErrorKind::Server(ServerErrorKind::NoPerm),
                        SENTINEL_REFUSED,
                        format!(
                            "{} at {}: {e}",
                            url_kind(&self.shared.url),
                            host_port(host, port)
                        ),
                    ))
                } else {
                    e
                }
            })
    }

    async fn open_master(&self, host: &str, port: u16) -> RedisResult<Master> {
        let client = self.client(self.shared.url.master_info(host, port)?)?;
        let config = config(RESPONSE_TIMEOUT);
        let mut conns = Vec::with_capacity(self.shared.count);
        for _ in 0..self.shared.count {
            let mut conn = client
                .get_multiplexed_async_connection_with_config(&config)
                .await?;
            if conns.is_empty() {
                // The sentinels may still name a master that was demoted (or not yet know
                // the promoted one): only a node that says it is a master will do.
                let role: Vec<Value> = redis::cmd("ROLE").query_async(&mut conn).await?;
                let is_master = matches!(role.first(), Some(Value::BulkString(r)) if r == b"master")
                    || matches!(role.first(), Some(Value::SimpleString(r)) if r == "master");
                if !is_master {
                    return Err(RedisError::from((
                        ErrorKind::Server(ServerErrorKind::ReadOnly),
                        "the node the sentinels name is not a master (yet)",
                        host_port(host, port),
                    )));
                }
            }
            conns.push(conn);
        }
        Ok(Master {
            addr: host_port(host, port),
            conns: conns.into(),
        })
    }

    /// Classifies the outcome of a command sent on the connections of `generation`: a lost
    /// or demoted master drops them, and the error becomes an I/O error (retryable).
    fn observe<T>(&self, generation: u64, addr: &str, result: RedisResult<T>) -> RedisResult<T> {
        let Err(e) = result else { return result };
        if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() {
            self.forget(generation, &e);
            return Err(e);
        }
        if not_master(&e) {
            self.forget(generation, &e);
            return Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                format!(
                    "{addr} is not the master of {:?} any more ({e}); the next command asks the sentinels",
                    self.shared.url.master_name
                ),
            )));
        }
        Err(e)
    }
}

/// A reply that says the node is no longer (or not yet) a writable master. A pgfence script
/// reports a refused write in its own error text (`fence counter unusable: READONLY ...`).
fn not_master(e: &RedisError) -> bool {
    if matches!(
        e.kind(),
        ErrorKind::Server(
            ServerErrorKind::ReadOnly | ServerErrorKind::MasterDown | ServerErrorKind::BusyLoading
        )
    ) {
        return true;
    }
    let text = e.to_string();
    text.contains("READONLY") || text.contains("MASTERDOWN")
}

/// `sentinel` or `TLS sentinel`, for messages.
fn url_kind(url: &SentinelUrl) -> &'static str {
    if url.tls { "TLS sentinel" } else { "sentinel" }
}

/// Reads the TLS files of a `rediss+sentinel://` URL and readies rustls.
#[cfg(feature = "tls")]
fn open_tls(url: &SentinelUrl) -> Result<TlsFiles> {
    crate::tls::ensure_crypto_provider();
    TlsParams {
        cacert: url.cacert.clone(),
        cert: url.cert.clone(),
        key: url.key.clone(),
    }
    .read()
}

/// Without the `tls` feature: [`Error::IssuerNotBuilt`].
#[cfg(not(feature = "tls"))]
fn open_tls(_url: &SentinelUrl) -> Result<TlsFiles> {
    Err(crate::tls::not_built("rediss+sentinel://"))
}

fn timeout_error(what: &str, host: &str, port: u16) -> RedisError {
    RedisError::from(std::io::Error::new(
        std::io::ErrorKind::TimedOut,
        format!(
            "{what} at {} did not answer within {NODE_TIMEOUT:?}",
            host_port(host, port)
        ),
    ))
}

fn config(response: Duration) -> AsyncConnectionConfig {
    AsyncConnectionConfig::new()
        .set_connection_timeout(Some(NODE_TIMEOUT))
        .set_response_timeout(Some(response))
}

impl ConnectionLike for SentinelConnections {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a redis::Cmd) -> redis::RedisFuture<'a, Value> {
        Box::pin(async move {
            let (generation, addr, mut conn) = self.connection().await?;
            let result = conn.req_packed_command(cmd).await;
            self.observe(generation, &addr, result)
        })
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a redis::Pipeline,
        offset: usize,
        count: usize,
    ) -> redis::RedisFuture<'a, Vec<Value>> {
        Box::pin(async move {
            let (generation, addr, mut conn) = self.connection().await?;
            let result = conn.req_packed_commands(pipeline, offset, count).await;
            self.observe(generation, &addr, result)
        })
    }

    fn get_db(&self) -> i64 {
        self.shared.url.db
    }
}

impl RedisIssuer<SentinelConnections> {
    /// Connects through Redis Sentinel:
    /// `redis+sentinel://[user:pass@]host1:port1[,host2:port2...]/<master-name>[/db]`, or
    /// `rediss+sentinel://...` over TLS ([`SentinelUrl`]). The issuer follows the master
    /// through a failover ([`SentinelConnections`]); errors during one are retryable.
    ///
    /// # Errors
    /// As [`SentinelConnections::open`].
    pub async fn connect_sentinel(url: &str) -> Result<Self> {
        Ok(Self::new(SentinelConnections::open(url).await?))
    }

    /// Like [`RedisIssuer::connect_sentinel`] with `count` connections to the master, and commands
    /// waiting up to `failover_wait` for a master while none is reachable.
    ///
    /// # Errors
    /// As [`RedisIssuer::connect_sentinel`].
    pub async fn connect_sentinel_with(
        url: &str,
        count: NonZeroUsize,
        failover_wait: Duration,
    ) -> Result<Self> {
        Ok(Self::new(
            SentinelConnections::open_with(url, count, failover_wait).await?,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sentinel_urls() {
        let u = SentinelUrl::parse("redis+sentinel://h1:1,h2,[::1]:3/mymaster/2").unwrap();
        assert_eq!(
            u.sentinels,
            vec![
                ("h1".to_owned(), 1),
                ("h2".to_owned(), DEFAULT_SENTINEL_PORT),
                ("::1".to_owned(), 3)
            ]
        );
        assert_eq!((u.master_name.as_str(), u.db), ("mymaster", 2));
        assert_eq!((u.username.as_deref(), u.password.as_deref()), (None, None));

        let u =
            SentinelUrl::parse("REDIS+SENTINEL://app:p%40ss@10.0.0.1:26379/m?sentinel_password=s3")
                .unwrap();
        assert_eq!(
            (u.username.as_deref(), u.password.as_deref(), u.db),
            (Some("app"), Some("p@ss"), 0)
        );
        assert_eq!(u.sentinel_password.as_deref(), Some("s3"));
        assert_eq!(u.to_string(), "redis+sentinel://app:***@10.0.0.1:26379/m");
        assert!(!format!("{u:?}").contains("p@ss"));

        let u = SentinelUrl::parse("redis+sentinel://:secret@h/m/").unwrap();
        assert_eq!((u.username, u.password.as_deref()), (None, Some("secret")));

        for bad in [
            "redis://h:1/m",
            "redis+sentinel:///m",
            "redis+sentinel://h:1",
            "redis+sentinel://h:1/",
            "redis+sentinel://h:x/m",
            "redis+sentinel://h:0/m",
            "redis+sentinel://h:1/m/-1",
            "redis+sentinel://h:1/m/1/x",
            "redis+sentinel://h:1/m?nope=1",
            "redis+sentinel://u:p%zz@h:1/m",
        ] {
            let err = SentinelUrl::parse(bad).unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::IssuerUrl(_))),
                "{bad}: {err}"
            );
            assert!(!err.to_string().contains("p%zz"), "{err}");
        }
        assert!(is_sentinel_url("redis+sentinel://h/m"));
        assert!(!is_sentinel_url("redis://h"));
    }

    #[test]
    fn parses_tls_sentinel_urls() {
        let u = SentinelUrl::parse(
            "Rediss+Sentinel://app:pw@h1:1,h2/m/3?cacert=/etc/ca%20x.pem&sentinel_password=s&cert=/c.pem&key=/k.pem",
        )
        .unwrap();
        assert!(u.tls);
        assert_eq!(u.sentinels.len(), 2);
        assert_eq!((u.master_name.as_str(), u.db), ("m", 3));
        assert_eq!(u.sentinel_password.as_deref(), Some("s"));
        assert_eq!(
            u.cacert.as_deref(),
            Some(std::path::Path::new("/etc/ca x.pem"))
        );
        assert!(u.cert.is_some() && u.key.is_some());
        assert_eq!(u.to_string(), "rediss+sentinel://app:***@h1:1,h2:26379/m/3");
        assert!(matches!(
            u.addr("h1", 1),
            ConnectionAddr::TcpTls {
                insecure: false,
                ..
            }
        ));
        let plain = SentinelUrl::parse("redis+sentinel://h/m").unwrap();
        assert!(!plain.tls && plain.cacert.is_none());
        assert!(matches!(plain.addr("h", 1), ConnectionAddr::Tcp(..)));

        for bad in [
            "redis+sentinel://h/m?cacert=/ca.pem",
            "rediss+sentinel://h/m?cert=/c.pem",
        ] {
            let err = SentinelUrl::parse(bad).unwrap_err();
            assert!(
                matches!(err, Error::Invalid(InvalidInput::Tls(_))),
                "{bad}: {err}"
            );
        }
        assert!(is_sentinel_url("rediss+sentinel://h/m"));
        assert!(!is_sentinel_url("rediss+sentinelx://h/m"));
    }

    #[test]
    fn a_demoted_master_is_told_apart() {
        let readonly = RedisError::from((
            ErrorKind::Server(ServerErrorKind::ReadOnly),
            "READONLY",
            "You can't write against a read only replica.".to_owned(),
        ));
        assert!(not_master(&readonly));
        let script = RedisError::from((
            ErrorKind::Extension,
            "pgfence:",
            "fence counter unusable: READONLY You can't write against a read only replica."
                .to_owned(),
        ));
        assert!(not_master(&script));
        let other = RedisError::from((ErrorKind::Extension, "pgfence:", "bad counter".to_owned()));
        assert!(!not_master(&other));
    }
}
