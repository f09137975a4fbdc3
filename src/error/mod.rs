//! The library's error type, [`Error`]: every rejection, however it was detected (the
//! repository, the guard trigger, `pgfence.check`), is the same typed variant, and
//! [`Error::kind`] groups the variants into what a caller does about them ([`ErrorKind`]).
//! [`sqlstate`] holds the codes pgfence's SQL raises.

use std::fmt;

mod backend;
mod detail;
mod invalid;
pub mod sqlstate;

pub(crate) use backend::describe_sqlx;
pub use backend::{BackendError, BackendKind};
pub use invalid::InvalidInput;

use detail::from_detail;
use sqlstate::{
    BYPASS_REFUSED as SQLSTATE_BYPASS_REFUSED, DUPLICATE as SQLSTATE_DUPLICATE,
    FAILED_OVER as SQLSTATE_FAILED_OVER, FENCE_TYPE as SQLSTATE_FENCE_TYPE,
    LEASELESS as SQLSTATE_LEASELESS, PROTECTED as SQLSTATE_PROTECTED, SEALED as SQLSTATE_SEALED,
    STALE as SQLSTATE_STALE, TOKEN_JUMP as SQLSTATE_TOKEN_JUMP,
};

const TOKEN_AS_FENCE_NOTE: &str = " (the statement set the fence to a fence token, not a fence: hand-written SQL sets fence = Lease::fence() / $PGFENCE_FENCE; docs/sql.md, \"Porting hand-written fenced SQL\")";

/// What a call cut off by its bound ([`Error::TimedOut`]) may have done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum TimedOut {
    /// Nothing applied, and nothing can apply later: nothing was sent yet (a single-row write
    /// still waiting for a connection), or a batch, check or effect ran in its own
    /// transaction, whose `COMMIT` was never sent. Retry with the same lease.
    NotApplied,
    /// The statement was sent and its answer did not come: it applied, or did not, or — a
    /// single-row write, which is one autocommit statement — may still apply until the
    /// server ends it (the library closed its connection; the server notices within
    /// `client_connection_check_interval`, which `pgfence migrate` sets to 1 s, or when its
    /// lock wait ends). Either way it is ordered before the lease's next write to the row:
    /// that write expects the fence the row had before, so a late arrival of this statement
    /// changes nothing once the next write applied. Retry with the same lease: an `update` or
    /// `upsert` stores its values once more (over the first attempt if that applied), a
    /// `delete` reports [`Error::NotFound`] if the first applied. (A batch's `COMMIT` sent
    /// without an answer is also in doubt, as before.)
    InDoubt,
    /// The write ran inside the caller's transaction: what reached the server belongs to it.
    /// Roll that transaction back (drop it) and retry in a new one; do not commit it.
    CallerTransaction,
}

fn timed_out_message(
    operation: &str,
    target: &str,
    after: std::time::Duration,
    outcome: TimedOut,
) -> String {
    let what = match outcome {
        TimedOut::NotApplied => {
            "nothing applied and nothing can apply later (its transaction is never committed); \
             retry with the same lease"
        }
        TimedOut::InDoubt => {
            "it was sent and not answered, so it applied or not (and may until the server ends \
             it); retry with the same lease: the retry is ordered after it"
        }
        TimedOut::CallerTransaction => {
            "it ran inside your transaction: roll the transaction back (drop it) and retry in \
             a new one"
        }
    };
    format!(
        "{operation} on {target} timed out after {} ms: {what}",
        after.as_millis()
    )
}

/// The text of [`Error::LeaselessWrite`]: what the statement did to the fence and what to
/// write instead.
fn leaseless_message(table: &str, old: i64, new: i64) -> String {
    let fix = "under a lease set fence = Lease::fence() / $PGFENCE_FENCE (or pgfence.next_fence), or bypass the guard with pgfence.bypass(reason) as an allowed role";
    if old == new {
        format!(
            "lease-less write refused on {table}: the UPDATE left fence as it was (every UPDATE of a guarded table is a lease's write, which advances it, or an audited bypass); {fix}"
        )
    } else if new > 0 && crate::token::FenceToken::of_fence(new) == 0 {
        format!(
            "lease-less write refused on {table}: fence {old} -> {new} sets the fence to a fence token, not a fence (a stored fence is token << 24 | tag << 12 | sequence); {fix}; docs/sql.md, \"Porting hand-written fenced SQL\""
        )
    } else {
        format!(
            "lease-less write refused on {table}: fence {old} -> {new} is not a lease's write (fence = fence + n is not one); {fix}"
        )
    }
}

const OTHER_COUNTER_NOTE: &str = " (the current token came from another resource's counter: resources that write the same rows must share a fencing domain)";

/// What a rejected write or check addressed, as structured data.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum StaleTarget {
    /// A row, through the repository: the quoted table and the key as a JSON array.
    Row {
        /// The quoted table name.
        table: String,
        /// The key, as a JSON array.
        key: String,
        /// The resource the rejected lease was issued for, when the write said
        /// ([`Fencing::resource`](crate::Fencing::resource); set for writes made with a lease).
        resource: Option<String>,
        /// Another resource of the same fencing domain whose lease holds the row now: it
        /// checked that resource ([`Fence::check`](crate::Fence::check)) with the current
        /// token. `None` when the newer lease was of the same resource, or is not known.
        held_by: Option<Box<str>>,
    },
    /// A resource's high-water mark (`Fence::check`, `pgfence.check`).
    Resource(String),
    /// A row of a table, found by the guard trigger or `pgfence.next_fence` (raw SQL; the key
    /// is not known).
    Table(String),
}

impl StaleTarget {
    /// The resource whose lease was rejected, when known.
    #[must_use]
    pub fn resource(&self) -> Option<&str> {
        match self {
            StaleTarget::Resource(r) => Some(r),
            StaleTarget::Row { resource, .. } => resource.as_deref(),
            StaleTarget::Table(_) => None,
        }
    }
}

impl fmt::Display for StaleTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StaleTarget::Row {
                table,
                key,
                held_by: Some(by),
                ..
            } => write!(f, "{table} {key} (taken over by resource {by})"),
            StaleTarget::Row { table, key, .. } => write!(f, "{table} {key}"),
            StaleTarget::Table(t) if t == "?" => f.write_str(
                "a row of a table pgfence.next_fence was not told (pass the table as its 4th argument)",
            ),
            StaleTarget::Resource(r) | StaleTarget::Table(r) => f.write_str(r),
        }
    }
}

/// What kind of failure an [`Error`] is, for callers that act on the kind rather than on
/// each variant: [`Error::kind`]. New variants join one of these kinds.
///
/// ```
/// use pgfence::error::ErrorKind;
///
/// fn next_step(e: &pgfence::Error) -> &'static str {
///     match e.kind() {
///         ErrorKind::Fenced => "stop: this lease is over; take a new one",
///         ErrorKind::Transient => "retry the same operation",
///         ErrorKind::NotFound => "nothing to write",
///         ErrorKind::Invalid | ErrorKind::Setup => "fix the input or the deployment",
///         _ => "log and fail the job",
///     }
/// }
/// let e = pgfence::Resource::new("").unwrap_err();
/// assert_eq!(next_step(&e), "fix the input or the deployment");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The lease is fenced out and nothing was applied: a newer lease wrote or checked
    /// ([`Error::StaleToken`]), the counter handed the token out twice
    /// ([`Error::DuplicateToken`]), the row changed outside the protocol
    /// ([`Error::RowSealed`]), the token is implausibly far ahead ([`Error::TokenJump`]), or
    /// the database failed over since the lease first wrote ([`Error::FencedByFailover`]).
    /// Never retry with the same lease.
    Fenced,
    /// The guard refused a write made without a lease ([`Error::LeaselessWrite`]) or a bypass
    /// it does not allow ([`Error::BypassRefused`]).
    Refused,
    /// The row ([`Error::NotFound`]) or table ([`Error::TableNotFound`]) does not exist.
    NotFound,
    /// The row is not as the caller expected: its own condition on a conditional write did
    /// not hold ([`Error::ConditionFailed`]). The lease still holds the row: re-read it and
    /// decide (retrying the same write fails the same way).
    Conflict,
    /// Input refused before anything was sent: a token, resource, owner, identifier, table
    /// declaration, batch, duration, effect, key prefix, issuer URL ([`InvalidInput::IssuerUrl`],
    /// for every issuer) or TLS setting.
    Invalid,
    /// The deployment must change: a feature not built ([`Error::IssuerNotBuilt`]), TLS an
    /// issuer cannot do ([`Error::TlsUnsupported`]), a missing Redis ACL permission
    /// ([`Error::RedisPermission`]), a schema this role may not migrate
    /// ([`Error::MigrationNotPermitted`]), or a `fence` column of the wrong type
    /// ([`Error::FenceColumnType`]).
    Setup,
    /// Transient: the same operation may be retried as is ([`Error::is_retryable`]): a
    /// concurrent change ([`Error::Contended`]), a lost connection, a serialization failure,
    /// a lock service failing over.
    Transient,
    /// Any other error of PostgreSQL, a migration or a lock service.
    Backend,
}

/// `Result` with pgfence's [`Error`] as the default error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in pgfence.
///
/// Match on the variants you act on; use [`Error::is_stale`] and [`Error::is_retryable`]
/// rather than inspecting messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A newer lease has already written, claimed or checked the row or resource
    /// (`current > presented`). The write was not applied. Do not retry with the same lease.
    #[error(
        "stale fence token on {target}: presented {presented}, current {current}{}",
        if *other_counter { OTHER_COUNTER_NOTE } else if *presented == 0 { TOKEN_AS_FENCE_NOTE } else { "" }
    )]
    StaleToken {
        /// What the write targeted.
        target: StaleTarget,
        /// The token the write carried.
        presented: i64,
        /// The token of the lease that wrote the row or checked the resource (`> presented`,
        /// or equal when it came from another counter).
        current: i64,
        /// `current` came from another token counter (another resource or fencing domain):
        /// the two resources' tokens are not comparable. Resources that write the same rows
        /// belong in one fencing domain ([`Resource::in_domain`](crate::Resource::in_domain)).
        other_counter: bool,
    },

    /// Another lease presented the same token at this row or resource: the token counter went
    /// backwards (a Redis failover lost increments) and handed one token out twice. Nothing
    /// was applied. Reseed the counter ([`RedisIssuer::recover_from`](crate::RedisIssuer::recover_from))
    /// and take a new lease.
    #[error(
        "duplicate fence token on {target}: token {token} was already presented by another lease (the token counter went backwards; reseed it)"
    )]
    DuplicateToken {
        /// What the write targeted.
        target: StaleTarget,
        /// The token both leases hold.
        token: i64,
    },

    /// The row was sealed after this lease wrote it: it was changed outside the fencing
    /// protocol (an audited bypass, or a write let through in observe mode), so this lease's
    /// picture of it is out of date. Nothing was applied (audited like a stale write); take a
    /// new lease and re-read the row. (A row a 0.2 lease wrote 4,096 times reads as sealed
    /// too.)
    #[error(
        "{target} was changed outside the fencing protocol after lease {token} wrote it (sealed); nothing was applied: take a new lease and re-read it"
    )]
    RowSealed {
        /// What the write targeted.
        target: StaleTarget,
        /// The lease's token.
        token: i64,
    },

    /// The guard trigger refused a bypass of the guard: `pgfence.bypass` was set without
    /// `pgfence.bypass(reason)` in the writing transaction (a plain `SET` would outlive its
    /// transaction), or by a role the schema owner did not allow
    /// ([`allow_bypass`](crate::guard::allow_bypass)). Nothing was written.
    #[error("bypass of the guard on {table} refused for role {role} (reason {reason:?}): {why}")]
    BypassRefused {
        /// The quoted table.
        table: String,
        /// The role that tried.
        role: String,
        /// The reason it gave.
        reason: String,
        /// Why it was refused, as the trigger said.
        why: String,
    },

    /// The token is more than `max_jump` above the current token of the row or resource mark
    /// (`pgfence.max_token_jump()`): a forged or corrupted token, which would lock every real
    /// lease out if it were stored. Nothing was written; the rejection is audited where the
    /// refusal allows it ([`Fence::check`](crate::Fence::check), `pgfence.try_check`,
    /// `pgfence.admits`) and the server log has it. The schema owner can change the bound
    /// (`SELECT pgfence.set_max_token_jump(n)`).
    #[error(
        "token {presented} refused on {target}: more than {max_jump} above its current token {current} (a forged or corrupted token?)"
    )]
    TokenJump {
        /// What the write or check targeted.
        target: StaleTarget,
        /// The token presented.
        presented: i64,
        /// The current token.
        current: i64,
        /// The bound.
        max_jump: i64,
    },

    /// The guard trigger refused a lease-less UPDATE that changed a row's fence in a way no
    /// lease's write does (`fence = fence + 1`): it would have looked like the current
    /// lease's next write and been overwritten by it. Write under a lease (`pgfence run`,
    /// `pgfence.next_fence`) or bypass (`pgfence.bypass(reason)`). Not audited: the trigger's
    /// transaction rolls back; the PostgreSQL server log has it.
    #[error("{}", leaseless_message(table, *old, *new))]
    LeaselessWrite {
        /// The quoted table.
        table: String,
        /// The row's fence.
        old: i64,
        /// The fence the UPDATE tried to store.
        new: i64,
    },

    /// The database failed over after this lease first wrote or checked through it: the lease
    /// is bound to the PostgreSQL timeline it first wrote on, and the database is now on a
    /// later one (a standby was promoted; with asynchronous replication the promotion may
    /// have lost commits the lease saw acknowledged, so its picture of the data may be gone).
    /// Nothing was applied; the rejection is logged and audited. Take a new lease: leases
    /// acquired after the promotion write as usual.
    #[error(
        "lease {presented} fenced out on {target} by a database failover: it first wrote on PostgreSQL timeline {lease_timeline}, the database is now on timeline {timeline} (a promotion that may have lost commits); take a new lease"
    )]
    FencedByFailover {
        /// What the write or check targeted.
        target: StaleTarget,
        /// The lease's token.
        presented: i64,
        /// The timeline the lease is bound to (its first fenced statement ran on it).
        lease_timeline: i64,
        /// The database's timeline now.
        timeline: i64,
    },

    /// A call did not finish within its bound ([`Repository::with_call_timeout`](crate::Repository::with_call_timeout),
    /// 30 s by default): what was sent may still be on its way, and [`TimedOut`] says what
    /// that means for the write. A WARN event is logged.
    #[error("{}", timed_out_message(operation, target, *after, *outcome))]
    TimedOut {
        /// The call (`update`, `claim`, `update_many`...).
        operation: &'static str,
        /// What it addressed (the quoted table).
        target: String,
        /// The bound.
        after: std::time::Duration,
        /// What the caller may conclude.
        outcome: TimedOut,
    },

    /// The row the fenced write addressed does not exist (never reported for a stale write).
    #[error("no row in {table} with key {key}")]
    NotFound {
        /// The (quoted) table name.
        table: String,
        /// The key, as a JSON array.
        key: String,
    },

    /// A conditional write ([`Repository::update_if`](crate::Repository::update_if),
    /// `update_columns_if`, `delete_if`) found the row, its fence admitted the lease, and the
    /// caller's own [`Condition`](crate::repository::Condition) did not hold (an optimistic
    /// lock's `version = $n` met another version): nothing was applied. Not a fence's refusal
    /// (those report [`Error::StaleToken`] and the other fenced errors, and win when both
    /// refuse), not audited. The lease may go on: re-read the row and decide.
    #[error(
        "{operation} on {table} {key} not applied: the row does not meet the write's condition ({condition}); the lease still holds the row: re-read it and decide"
    )]
    ConditionFailed {
        /// The quoted table.
        table: String,
        /// The key, as a JSON array.
        key: String,
        /// `update` or `delete`.
        operation: &'static str,
        /// The condition, without its values ([`Condition`](crate::repository::Condition)'s
        /// `Display`).
        condition: String,
    },

    /// Input refused before anything was sent (nothing changed): which input and why is
    /// [`InvalidInput`].
    #[error("{0}")]
    Invalid(InvalidInput),

    /// The table to guard does not exist.
    #[error("table {0} does not exist")]
    TableNotFound(String),

    /// The table already has a `fence` column of a type other than `bigint`.
    #[error("{table}.fence has type {found}; pgfence needs bigint (rename or convert the column)")]
    FenceColumnType {
        /// The table.
        table: String,
        /// The type found.
        found: String,
    },

    /// Concurrent activity on the row changed it while the write was being classified
    /// (for example it was deleted mid-statement). Nothing was applied; retry is safe.
    #[error("row in {table} changed concurrently during {operation}; retry")]
    Contended {
        /// The table.
        table: String,
        /// The fenced operation.
        operation: &'static str,
    },

    /// The issuer an URL selects is not compiled in: `scheme` needs pgfence's cargo `feature`.
    #[error(
        "{scheme} issuer URLs need pgfence's `{feature}` feature; rebuild with it enabled (cargo: features = [\"{feature}\"], or --features pgfence/{feature})"
    )]
    IssuerNotBuilt {
        /// The URL scheme: `etcd://` or `zk://` (features `etcd`, `zk`), or a TLS scheme
        /// (`rediss://`, `rediss+sentinel://`, `etcd+https://`: feature `tls`).
        scheme: &'static str,
        /// The cargo feature that provides it.
        feature: &'static str,
    },

    /// The issuer cannot connect over TLS (ZooKeeper): the URL asked for TLS. Reach the
    /// servers through a TLS tunnel and give the tunnel's local end as a plain URL.
    #[error(
        "{issuer} over TLS is not supported by pgfence: connect through a TLS tunnel (stunnel, ghostunnel, a service mesh sidecar) and give its local end as a plain {scheme} URL"
    )]
    TlsUnsupported {
        /// The issuer (`ZooKeeper`).
        issuer: &'static str,
        /// The plain scheme to use towards the tunnel (`zk://`).
        scheme: &'static str,
    },

    /// Redis refused an issuer command for lack of an ACL permission (`NOPERM`, or a script's
    /// command or key refused). `rule` is what the ACL user needs
    /// ([`redis::acl_rule`](crate::issuer::redis::acl_rule) for the issuer's key prefix, or
    /// [`redis::SENTINEL_ACL_RULE`](crate::issuer::redis::SENTINEL_ACL_RULE) on a sentinel). Not
    /// retryable: fix the user's ACL.
    #[error(
        "Redis ACL user lacks a permission the issuer needs ({source}); {what} needs: ACL SETUSER <user> {rule} (docs/operations.md, \"Redis ACL\")"
    )]
    RedisPermission {
        /// Who needs the rule: `the issuer's user` or `the sentinels' user`.
        what: &'static str,
        /// The ACL rules the user needs (after `ACL SETUSER <user>`).
        rule: String,
        /// Redis's refusal.
        #[source]
        source: redis::RedisError,
    },

    /// pgfence's schema is behind this version and the connected role may not migrate it (no
    /// `CREATE` on schema `pgfence`): a deploy-time job for the schema's owner.
    #[error("{}", if !*installed {
        format!("pgfence's schema is not installed in this database and role {role:?} may not create it: run `pgfence migrate` (pgfence::admin::migrate) once as the database owner or a role with CREATE on the database (deploy time), then `pgfence grant {role}`, then start the application")
    } else if *applied == 0 {
        format!("role {role:?} may not read pgfence's schema (it was not granted) and may not migrate it: run `pgfence migrate` as the owner of schema pgfence (deploy time), then `pgfence grant {role}`, then start the application")
    } else {
        format!("pgfence's schema is behind (applied V{applied}, this version ships V{latest}) and role {role:?} may not migrate it: run `pgfence migrate` as the owner of schema pgfence (deploy time), then start the application")
    })]
    MigrationNotPermitted {
        /// The connected role.
        role: String,
        /// The newest applied migration this role could see (0 when it could not read it).
        applied: i32,
        /// The newest migration this version ships.
        latest: i32,
        /// Whether the `pgfence` schema exists at all (a first deploy when not).
        installed: bool,
    },

    /// A deploy-time call (`guard`, `unguard`, `grant`, `allow_bypass`, `acknowledge_failover`,
    /// `audit::prune`...) made by a role that may not make it: PostgreSQL refused a privilege.
    /// `run_as` says who runs it (deploy time is the schema or table owner; run time, the
    /// granted application role, never needs these calls).
    #[error(
        "{command} refused: {message}; {command} is a deploy-time call: run it as {run_as}, not as the application's role"
    )]
    NotPermitted {
        /// The library call or CLI command, e.g. `pgfence guard`.
        command: &'static str,
        /// Who may run it.
        run_as: &'static str,
        /// PostgreSQL's message.
        message: String,
    },

    /// The connected role was never given pgfence's run-time privileges: PostgreSQL refused
    /// it schema `pgfence` (SQLSTATE `42501`, `permission denied for schema pgfence`), so no
    /// fenced write, claim or check can run as it. A deploy-time job for the schema's owner:
    /// `pgfence grant ROLE` ([`admin::grant`](crate::admin::grant)) for the role the
    /// application connects as. Nothing was applied.
    #[error(
        "the connected role lacks pgfence's grants ({message}, SQLSTATE 42501): as the owner of schema pgfence, run `pgfence grant ROLE` (pgfence::admin::grant) for the role the application connects as (deploy time), then retry"
    )]
    NotGranted {
        /// PostgreSQL's message.
        message: String,
    },

    /// A repository call addressed a table that is not guarded: it has no `fence` column
    /// (SQLSTATE `42703` on the column pgfence's statements read and write). Nothing was
    /// applied. Guard it once, at deploy time, as its owner: `pgfence guard TABLE`
    /// ([`guard::guard`](crate::guard::guard)); [`Repository::verify`](crate::Repository::verify)
    /// reports this and the rest of the table's setup at start-up.
    #[error(
        "table {table} is not guarded (it has no fence column): run `pgfence guard {table}` (pgfence::guard::guard) as its owner (deploy time), then retry"
    )]
    NotGuarded {
        /// The quoted table.
        table: String,
    },

    /// A claimed row did not decode into the type the caller asked for (a column name or
    /// type that does not match the table, a NULL in a non-`Option` field). The claim was
    /// rolled back: the row is as it was.
    #[error(
        "{operation} on {table} rolled back, nothing changed: the row does not decode into the requested type ({})",
        describe_sqlx(source)
    )]
    Decode {
        /// The quoted table.
        table: String,
        /// `claim` or `claim_many`.
        operation: &'static str,
        /// sqlx's decoding error (it names the column and the types).
        #[source]
        source: sqlx::Error,
    },

    /// pgfence's migration history holds migrations of an unreleased 0.3 build: V7 to V13 of
    /// `main` before they were squashed into one migration, `V7__pgfence_0_3`, for the release.
    /// Nothing was changed. The fix, as the owner of schema `pgfence`: delete those history rows
    /// and migrate again (`V7__pgfence_0_3` applies over the objects they created and leaves
    /// the schema a 0.3 database has), or recreate the database.
    #[error(
        "pgfence's migration history holds {} of an unreleased 0.3 build (squashed into V7__pgfence_0_3 before the release); nothing was changed: as the owner of schema pgfence run `DELETE FROM pgfence.refinery_schema_history WHERE version BETWEEN 7 AND 13`, then `pgfence migrate` again (V7 applies over what they created), or recreate the database",
        versions.iter().map(|v| format!("V{v}")).collect::<Vec<_>>().join(", ")
    )]
    UnreleasedMigrations {
        /// The versions recorded by the unreleased build.
        versions: Vec<i32>,
    },

    /// PostgreSQL, a migration or a lock service failed (a connection lost, a server error
    /// pgfence does not map, a timeout): [`BackendError`] says which
    /// ([`kind`](BackendError::kind)) and whether to retry
    /// ([`is_retryable`](BackendError::is_retryable)), the same shape whatever features are
    /// built.
    #[error(transparent)]
    Backend(BackendError),
}

impl Error {
    /// The kind of failure: what a caller does about it ([`ErrorKind`]).
    #[must_use]
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::StaleToken { .. }
            | Error::DuplicateToken { .. }
            | Error::RowSealed { .. }
            | Error::TokenJump { .. }
            | Error::FencedByFailover { .. } => ErrorKind::Fenced,
            Error::BypassRefused { .. } | Error::LeaselessWrite { .. } => ErrorKind::Refused,
            Error::NotFound { .. } | Error::TableNotFound(_) => ErrorKind::NotFound,
            Error::ConditionFailed { .. } => ErrorKind::Conflict,
            Error::Invalid(_) | Error::Decode { .. } => ErrorKind::Invalid,
            Error::IssuerNotBuilt { .. }
            | Error::TlsUnsupported { .. }
            | Error::RedisPermission { .. }
            | Error::MigrationNotPermitted { .. }
            | Error::NotPermitted { .. }
            | Error::NotGranted { .. }
            | Error::NotGuarded { .. }
            | Error::UnreleasedMigrations { .. }
            | Error::FenceColumnType { .. } => ErrorKind::Setup,
            _ if self.is_retryable() => ErrorKind::Transient,
            _ => ErrorKind::Backend,
        }
    }

    /// True when a write was rejected because a newer lease had written or checked.
    #[must_use]
    pub fn is_stale(&self) -> bool {
        matches!(self, Error::StaleToken { .. })
    }

    /// True when the token counter handed one token to two leases ([`Error::DuplicateToken`]).
    #[must_use]
    pub fn is_duplicate(&self) -> bool {
        matches!(self, Error::DuplicateToken { .. })
    }

    /// True when the error is transient and the same operation may be retried as is
    /// (connection loss, serialization failure, deadlock, concurrent change). A stale token is
    /// never retryable: take a new lease instead.
    ///
    /// Serialization failures (SQLSTATE `40001`, e.g. a `Fence::check` under REPEATABLE READ
    /// that met a concurrent holder) and deadlocks (`40P01`) are retryable: the whole
    /// transaction was rolled back, so retry it from the start — re-running only the failed
    /// statement inside the aborted transaction fails again.
    #[must_use]
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Contended { .. } => true,
            Error::TimedOut { outcome, .. } => *outcome != TimedOut::CallerTransaction,
            Error::Backend(e) => e.is_retryable(),
            _ => false,
        }
    }
    pub(crate) fn database(e: sqlx::Error) -> Self {
        Error::Backend(BackendError::new(backend::Source::Database(e)))
    }

    pub(crate) fn migration(e: refinery_core::Error) -> Self {
        Error::Backend(BackendError::new(backend::Source::Migration(e)))
    }

    pub(crate) fn redis(e: redis::RedisError) -> Self {
        Error::Backend(BackendError::new(backend::Source::Redis(e)))
    }

    #[cfg(feature = "etcd")]
    pub(crate) fn etcd(e: etcd_client::Error) -> Self {
        Error::Backend(BackendError::new(backend::Source::Etcd(e)))
    }

    #[cfg(feature = "zk")]
    pub(crate) fn zookeeper(e: zookeeper_client::Error) -> Self {
        Error::Backend(BackendError::new(backend::Source::ZooKeeper(e)))
    }

    /// The ZooKeeper client's error inside an [`Error::Backend`] (crate-internal).
    #[cfg(feature = "zk")]
    pub(crate) fn as_zk(&self) -> Option<&zookeeper_client::Error> {
        match self {
            Error::Backend(b) => b.as_zk(),
            _ => None,
        }
    }
}

/// The error of a deploy-time call (`command`, run as `run_as`): a privilege PostgreSQL
/// refused (SQLSTATE `42501`) is [`Error::NotPermitted`], naming the call and who runs it;
/// anything else maps as usual.
pub(crate) fn deploy_time(
    command: &'static str,
    run_as: &'static str,
) -> impl FnOnce(sqlx::Error) -> Error {
    move |e| {
        if let sqlx::Error::Database(db) = &e
            && db.code().as_deref() == Some(INSUFFICIENT_PRIVILEGE)
        {
            return Error::NotPermitted {
                command,
                run_as,
                message: db.message().to_owned(),
            };
        }
        Error::from(e)
    }
}

/// SQLSTATE `insufficient_privilege`.
const INSUFFICIENT_PRIVILEGE: &str = "42501";
/// SQLSTATE `undefined_column`.
const UNDEFINED_COLUMN: &str = "42703";
/// PostgreSQL's refusal of schema `pgfence` to a role without `USAGE` on it: a role
/// `pgfence grant` never ran for.
const NO_SCHEMA_USAGE: &str = "permission denied for schema pgfence";

impl Error {
    /// `self`, or [`Error::NotGuarded`] when it is PostgreSQL's `undefined_column` (42703)
    /// for the `fence` column: the error of a repository call on `table` (the quoted name,
    /// asked for only then), whose statements all read or write that column.
    pub(crate) fn on_table(self, table: impl FnOnce() -> String) -> Error {
        let Error::Backend(backend) = &self else {
            return self;
        };
        let Some(sqlx::Error::Database(db)) = backend.as_sqlx() else {
            return self;
        };
        if db.code().as_deref() != Some(UNDEFINED_COLUMN) || !names_fence_column(db.message()) {
            return self;
        }
        Error::NotGuarded { table: table() }
    }
}

/// Whether PostgreSQL's `undefined_column` message is about a column `fence`: `column "fence"
/// does not exist`, `column "fence" of relation "t" does not exist`, `column t.fence does not
/// exist`.
fn names_fence_column(message: &str) -> bool {
    let Some(column) = message
        .strip_prefix("column ")
        .and_then(|m| m.split(" does not exist").next())
    else {
        return false;
    };
    let column = column.split(" of relation ").next().unwrap_or(column);
    column == "\"fence\"" || column.ends_with(".fence") || column.ends_with(".\"fence\"")
}

/// Who runs the calls that change pgfence's schema or its guarded tables.
pub(crate) const SCHEMA_OWNER: &str =
    "the owner of schema pgfence (the role that ran `pgfence migrate`) or a superuser";
/// Who runs `guard` / `unguard`: the table's owner, who must also own schema pgfence's
/// functions' rights to install the trigger.
pub(crate) const TABLE_OWNER: &str = "the owner of the table who also owns schema pgfence (the role that ran `pgfence migrate`), or a superuser";

impl From<sqlx::Error> for Error {
    /// Maps pgfence's SQLSTATEs to typed errors, so a stale write detected by the guard
    /// trigger or by `pgfence.check` is the same [`Error::StaleToken`] as one detected by the
    /// repository.
    fn from(e: sqlx::Error) -> Self {
        if let sqlx::Error::Database(db) = &e
            && let Some(pg) = db.try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
        {
            match pg.code() {
                SQLSTATE_BYPASS_REFUSED => {
                    let detail = pg.detail().unwrap_or("");
                    let (role, reason) = detail
                        .strip_prefix("role=")
                        .and_then(|d| d.split_once(" reason="))
                        .unwrap_or(("?", ""));
                    return Error::BypassRefused {
                        table: guard_table(pg),
                        role: role.to_owned(),
                        reason: reason.to_owned(),
                        why: pg
                            .message()
                            .split_once(": ")
                            .and_then(|(_, m)| m.split_once(": "))
                            .map_or(pg.message(), |(_, why)| why)
                            .to_owned(),
                    };
                }
                SQLSTATE_LEASELESS => {
                    let fences = pg
                        .detail()
                        .and_then(|d| d.strip_prefix("old="))
                        .and_then(|d| d.split_once(" new="))
                        .and_then(|(old, rest)| {
                            let new = rest.split(' ').next()?;
                            Some((old.parse().ok()?, new.parse().ok()?))
                        });
                    if let Some((old, new)) = fences {
                        return Error::LeaselessWrite {
                            table: guard_table(pg),
                            old,
                            new,
                        };
                    }
                }
                SQLSTATE_STALE | SQLSTATE_DUPLICATE | SQLSTATE_SEALED | SQLSTATE_TOKEN_JUMP
                | SQLSTATE_FAILED_OVER => {
                    if let Some(rejected) = from_detail(pg.code(), pg.detail().unwrap_or("")) {
                        return rejected;
                    }
                }
                SQLSTATE_FENCE_TYPE => {
                    return Error::FenceColumnType {
                        table: pg.table().unwrap_or("?").to_owned(),
                        found: pg.detail().unwrap_or("?").to_owned(),
                    };
                }
                SQLSTATE_PROTECTED => {
                    return Error::Invalid(InvalidInput::Table {
                        table: pg.table().unwrap_or("?").to_owned(),
                        reason: "pgfence and system tables cannot be guarded".to_owned(),
                    });
                }
                "42P01" => return Error::TableNotFound(missing_relation(pg)),
                INSUFFICIENT_PRIVILEGE if pg.message() == NO_SCHEMA_USAGE => {
                    return Error::NotGranted {
                        message: pg.message().to_owned(),
                    };
                }
                _ => {}
            }
        }
        Error::database(e)
    }
}

impl From<redis::RedisError> for Error {
    fn from(e: redis::RedisError) -> Self {
        Error::redis(e)
    }
}

/// `"schema"."table"` of an error the guard trigger raised (its SCHEMA and TABLE fields).
fn guard_table(pg: &sqlx::postgres::PgDatabaseError) -> String {
    pg.schema()
        .zip(pg.table())
        .and_then(|(schema, table)| crate::table::TableName::new(schema, table).ok())
        .map_or_else(|| "?".to_owned(), |t| t.quoted())
}

/// The relation a 42P01 error names: the TABLE field (pgfence's own errors set it), else the
/// name in the server's `relation "..." does not exist`.
fn missing_relation(pg: &sqlx::postgres::PgDatabaseError) -> String {
    if let Some(table) = pg.table() {
        return table.to_owned();
    }
    let msg = pg.message();
    msg.strip_prefix("relation \"")
        .and_then(|m| m.strip_suffix("\" does not exist"))
        .unwrap_or(msg)
        .to_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fence_column_messages() {
        for m in [
            "column \"fence\" does not exist",
            "column \"fence\" of relation \"acct\" does not exist",
            "column t.fence does not exist",
        ] {
            assert!(names_fence_column(m), "{m}");
        }
        for m in [
            "column \"fences\" does not exist",
            "column t.fence_at does not exist",
            "column \"balance\" of relation \"fence\" does not exist",
            "relation \"fence\" does not exist",
        ] {
            assert!(!names_fence_column(m), "{m}");
        }
    }

    #[test]
    fn kinds_group_the_variants() {
        let target = || StaleTarget::Resource("r".into());
        let cases = [
            (
                Error::StaleToken {
                    target: target(),
                    presented: 1,
                    current: 2,
                    other_counter: false,
                },
                ErrorKind::Fenced,
            ),
            (
                Error::FencedByFailover {
                    target: target(),
                    presented: 1,
                    lease_timeline: 1,
                    timeline: 2,
                },
                ErrorKind::Fenced,
            ),
            (
                Error::LeaselessWrite {
                    table: "t".into(),
                    old: 1,
                    new: 2,
                },
                ErrorKind::Refused,
            ),
            (Error::TableNotFound("t".into()), ErrorKind::NotFound),
            (
                Error::NotGranted {
                    message: NO_SCHEMA_USAGE.into(),
                },
                ErrorKind::Setup,
            ),
            (Error::NotGuarded { table: "t".into() }, ErrorKind::Setup),
            (
                Error::ConditionFailed {
                    table: "t".into(),
                    key: "[1]".into(),
                    operation: "update",
                    condition: "\"version\" = $value".into(),
                },
                ErrorKind::Conflict,
            ),
            (
                Error::Invalid(InvalidInput::IssuerUrl("x".into())),
                ErrorKind::Invalid,
            ),
            (
                Error::Invalid(InvalidInput::Token("0".into())),
                ErrorKind::Invalid,
            ),
            (
                Error::IssuerNotBuilt {
                    scheme: "zk://",
                    feature: "zk",
                },
                ErrorKind::Setup,
            ),
            (
                Error::Contended {
                    table: "t".into(),
                    operation: "update",
                },
                ErrorKind::Transient,
            ),
            (
                Error::database(sqlx::Error::PoolTimedOut),
                ErrorKind::Transient,
            ),
            (
                Error::database(sqlx::Error::RowNotFound),
                ErrorKind::Backend,
            ),
        ];
        for (error, kind) in cases {
            assert_eq!(error.kind(), kind, "{error}");
            assert_eq!(
                error.kind() == ErrorKind::Transient,
                error.is_retryable(),
                "{error}"
            );
        }
    }
}
