//! Least privilege for application roles: [`grant_sql`] and [`grant`].

use crate::error::InvalidInput;
use sqlx::{Acquire, AssertSqlSafe, Postgres};

use crate::{Error, Result, table::Ident};

/// The functions an application role may execute, with their argument types.
const APP_FUNCTIONS: &[&str] = &[
    "pgfence.check(pg_catalog.text, pg_catalog.int8, pg_catalog.int4)",
    "pgfence.check(pg_catalog.text, pg_catalog.int8, pg_catalog.int4, pg_catalog.int8)",
    "pgfence.check_on(pg_catalog.text, pg_catalog.int8, pg_catalog.int4, pg_catalog.int8)",
    "pgfence.try_check(pg_catalog.text, pg_catalog.int8, pg_catalog.int4, pg_catalog.int8)",
    "pgfence.admits(pg_catalog.int8, pg_catalog.int8, pg_catalog.int4, pg_catalog.regclass, \
     pg_catalog.text, pg_catalog.int8)",
    // Failover fencing (migration V7): the repository records the timeline it writes on, checks a
    // lease's, and audits a refusal with its reason. (The timeline forms' internal helpers,
    // `require_timeline` and `failover_refusal`, run inside functions with the owner's rights.)
    "pgfence.note_timeline()",
    "pgfence.append_audit(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8, \
     pg_catalog.int8, pg_catalog.text, pg_catalog.text, pg_catalog.bool, pg_catalog.text)",
    "pgfence.try_check(pg_catalog.text, pg_catalog.int8, pg_catalog.int4)",
    "pgfence.next_fence(pg_catalog.int8, pg_catalog.int8, pg_catalog.int4, pg_catalog.text)",
    "pgfence.admits(pg_catalog.int8, pg_catalog.int8, pg_catalog.int4, pg_catalog.regclass, \
     pg_catalog.text)",
    "pgfence.stop_unless(pg_catalog.bool, pg_catalog.text)",
    // Whether the role may bypass is the guard trigger's decision (allow_bypass), per row.
    "pgfence.bypass(pg_catalog.text)",
    "pgfence.lease_fence(pg_catalog.int8, pg_catalog.int4)",
    "pgfence.high_water(pg_catalog.text)",
    "pgfence.domain_high_water(pg_catalog.text)",
    "pgfence.domain_mark_holder(pg_catalog.text, pg_catalog.int8)",
    "pgfence.record_rejection(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8, \
     pg_catalog.int8, pg_catalog.text, pg_catalog.text, pg_catalog.int4, pg_catalog.bool, \
     pg_catalog.text)",
    "pgfence.append_audit(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8, \
     pg_catalog.int8, pg_catalog.text, pg_catalog.text, pg_catalog.bool)",
    "pgfence.issuer_acquire(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8)",
    "pgfence.issuer_release(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8)",
    "pgfence.issuer_extend(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8, \
     pg_catalog.int8)",
    "pgfence.issuer_status(pg_catalog.text, pg_catalog.text)",
    "pgfence.issuer_expire_idle(pg_catalog.text, pg_catalog.int8, pg_catalog.int4)",
    "pgfence.issuer_state(pg_catalog.text)",
    "pgfence.effect_begin(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8, \
     pg_catalog.int4, pg_catalog.text)",
    "pgfence.effect_finish(pg_catalog.text, pg_catalog.text, pg_catalog.text, pg_catalog.int8, \
     pg_catalog.int4, pg_catalog.text, pg_catalog.bool, pg_catalog.jsonb)",
    "pgfence.effect_status(pg_catalog.text, pg_catalog.text, pg_catalog.text)",
];

/// The SQL that gives `role` exactly an application's privileges on pgfence's schema — what
/// a role that writes through pgfence (the repository, `Fence::check`, the issuer's floor
/// source, `pgfence.check` / `try_check` / `next_fence` from SQL) needs, and nothing more. It
/// first revokes whatever `role` had on the schema's objects, then grants.
///
/// Since migration V5 nothing in the `pgfence` schema is usable by `PUBLIC` (except
/// `record_rejection`, which runs with the caller's rights and only calls `append_audit`, and
/// the numbers `schema_version()`, `timeline()` and `max_token_jump()`). The
/// functions that touch pgfence's tables on an application's behalf run with their owner's
/// rights (`SECURITY DEFINER`, pinned `search_path`, static SQL only), so an application role
/// gets `EXECUTE` on them and, on the tables, only what the library's own statements need:
///
/// | object | application role |
/// |---|---|
/// | schema `pgfence` | `USAGE` (and not `CREATE`: an earlier grant of it is revoked) |
/// | `check`, `check_on`, `try_check`, `admits`, `next_fence`, `lease_fence`, `high_water`, `domain_high_water`, `domain_mark_holder`, `note_timeline`, `append_audit` (owner's rights); `stop_unless`, `record_rejection`, `bypass` (caller's rights) | `EXECUTE` |
/// | the effect ledger's `effect_begin`, `effect_finish`, `effect_status` (owner's rights: fenced like a row write) | `EXECUTE` |
/// | the PostgreSQL issuer's `issuer_acquire`, `issuer_release`, `issuer_extend`, `issuer_status`, `issuer_expire_idle`, `issuer_state` (owner's rights: take a free lock, release or extend one's own, expire idle state, never lower a counter) | `EXECUTE` |
/// | `pgfence.tombstone` | `SELECT`, `INSERT`, `UPDATE (fence, deleted_at)`: a fenced delete writes its tombstone, an upsert reads it; a trigger refuses any update that lowers a tombstone's fence |
/// | `pgfence.audit` | `INSERT` on the columns the library writes (not `id`, `at`, `db_user`), for the rows an [`Auditor`](crate::audit::Auditor)'s pool writes; no `SELECT`, `UPDATE` or `DELETE` |
/// | `pgfence.resource_fence`, `guarded_tables`, `issuer_lock`, `issuer_counter`, `issuer_floor`, `effect`, the migration history | nothing |
/// | `guard`, `unguard`, `unpoison_resource` | nothing (owner and superusers only) |
/// | the internal functions (the fence layout's helpers, `refuse_token_jump`, `require_timeline`, `failover_refusal`...: docs/sql.md, "Functions") | nothing, and no role but the owner has them: only pgfence's own functions call them |
/// | `schema_version()` | `EXECUTE` (granted to every role: which migrations are applied) |
///
/// The application role must not own the guarded tables (a table's owner can
/// `ALTER TABLE ... DISABLE TRIGGER pgfence_guard`): give it `SELECT`, `INSERT`, `UPDATE`,
/// `DELETE` on them instead.
///
/// Run the SQL as the owner of the `pgfence` schema (the role that ran the migrations) or a
/// superuser, after the migrations; never for the owner itself (it would revoke the owner's
/// own privileges: [`grant`] refuses that). The role name is quoted ([`Ident::quoted`]), so
/// any name is safe to pass.
///
/// # Example
/// ```
/// let sql = pgfence::admin::grant_sql(&pgfence::table::Ident::new("billing_app").unwrap());
/// assert!(sql.contains("GRANT USAGE ON SCHEMA pgfence TO \"billing_app\";"));
/// ```
#[must_use]
pub fn grant_sql(role: &Ident) -> String {
    let r = role.quoted();
    format!(
        "-- pgfence: application privileges for {r}. Run as the owner of the pgfence schema.\n\
         REVOKE ALL ON ALL TABLES IN SCHEMA pgfence FROM {r};\n\
         REVOKE ALL ON ALL SEQUENCES IN SCHEMA pgfence FROM {r};\n\
         REVOKE ALL ON ALL FUNCTIONS IN SCHEMA pgfence FROM {r};\n\
         REVOKE ALL ON SCHEMA pgfence FROM {r};\n\
         GRANT USAGE ON SCHEMA pgfence TO {r};\n\
         GRANT EXECUTE ON FUNCTION\n    {functions}\n    TO {r};\n\
         GRANT SELECT, INSERT ON pgfence.tombstone TO {r};\n\
         GRANT UPDATE (fence, deleted_at) ON pgfence.tombstone TO {r};\n\
         GRANT INSERT (resource, table_name, row_key, presented, current, holder, operation, other_counter)\n    \
         ON pgfence.audit TO {r};\n",
        functions = APP_FUNCTIONS.join(",\n    "),
    )
}

/// Gives `role` exactly an application's privileges on pgfence's schema: runs
/// [`grant_sql`] in one transaction (a savepoint inside the caller's). Run it as
/// the owner of the `pgfence` schema or a superuser, after [`migrate`](crate::admin::migrate).
///
/// # Errors
/// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier) when `role` owns the `pgfence` schema (it already has every
/// privilege, and the revocations would take them away), or names `PUBLIC` (every role) or a
/// predefined `pg_*` role; [`Error::Backend`](crate::Error::Backend) when the role does not exist, pgfence's schema
/// is missing, or the caller may not grant.
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// pgfence::admin::grant(&pool, &pgfence::table::Ident::new("billing_app")?).await?;
/// # Ok(()) }
/// ```
pub async fn grant<'c, A>(conn: A, role: &Ident) -> Result<()>
where
    A: Acquire<'c, Database = Postgres>,
{
    if role.as_str().eq_ignore_ascii_case("public") {
        return Err(Error::Invalid(InvalidInput::Identifier {
            name: role.as_str().to_owned(),
            reason: "is every role (PUBLIC): grant an application's rights to one role, not to all",
        }));
    }
    if role.as_str().starts_with("pg_") {
        return Err(Error::Invalid(InvalidInput::Identifier {
            name: role.as_str().to_owned(),
            reason: "is a predefined PostgreSQL role (pg_*): grant to the application's own role",
        }));
    }
    let mut conn = conn.begin().await?;
    // GRANT and REVOKE by a role without the right only warn ("no privileges were granted"):
    // a grant run as the application role would change nothing without a word.
    let may_grant: bool = sqlx::query_scalar(
        "SELECT pg_catalog.pg_has_role(n.nspowner, 'USAGE') OR r.rolsuper \
           FROM pg_catalog.pg_namespace n, pg_catalog.pg_roles r \
          WHERE n.nspname OPERATOR(pg_catalog.=) 'pgfence' \
            AND r.rolname OPERATOR(pg_catalog.=) CURRENT_USER",
    )
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await?
    .unwrap_or(false);
    if !may_grant {
        return Err(Error::NotPermitted {
            command: "pgfence grant",
            run_as: crate::error::SCHEMA_OWNER,
            message: "the connected role does not own schema pgfence (or it is not installed: run `pgfence migrate` first)".to_owned(),
        });
    }
    let owns_schema: Option<bool> = sqlx::query_scalar(
        "SELECT n.nspowner OPERATOR(pg_catalog.=) r.oid FROM pg_catalog.pg_roles r \
         JOIN pg_catalog.pg_namespace n ON n.nspname OPERATOR(pg_catalog.=) 'pgfence' \
         WHERE r.rolname OPERATOR(pg_catalog.=) $1::pg_catalog.name",
    )
    .bind(role.as_str())
    .persistent(false)
    .fetch_optional(&mut *conn)
    .await?;
    if owns_schema == Some(true) {
        return Err(Error::Invalid(InvalidInput::Identifier {
            name: role.as_str().to_owned(),
            reason: "owns the pgfence schema; grant is for application roles",
        }));
    }
    // The role name is quoted by `Ident::quoted`; everything else is constant text.
    sqlx::raw_sql(AssertSqlSafe(grant_sql(role)))
        .execute(&mut *conn)
        .await
        .map_err(crate::error::deploy_time(
            "pgfence grant",
            crate::error::SCHEMA_OWNER,
        ))?;
    conn.commit().await?;
    Ok(())
}

/// Sets `role`'s default `idle_in_transaction_session_timeout` in the connected database to
/// `bound` (`ALTER ROLE ... IN DATABASE ... SET`), or removes it with `None` (`RESET`: the
/// server's default again): PostgreSQL then ends any transaction of that role that sits idle
/// longer than `bound`, whatever statements it ran. The server-side bound for a lease's
/// transaction that does not start with [`Fence::check`](crate::Fence::check) (which bounds it
/// by the lease's TTL itself, [`Fencing::idle_bound`](crate::Fencing::idle_bound)): a worker
/// paused inside a transaction of repository writes or raw SQL releases its row locks `bound`
/// after its last statement. Pick the longest lease TTL the role's jobs use, and longer than
/// any transaction it leaves idle on purpose. New sessions take it (pools: new connections);
/// `pgfence grant ROLE --idle-in-transaction-timeout DURATION` runs it. See
/// docs/operations.md, "A paused lease's transaction".
///
/// # Errors
/// [`InvalidInput::Duration`](crate::error::InvalidInput::Duration) for a bound under 1 ms or
/// over `i32::MAX` ms (nothing is sent); [`Error::NotPermitted`](crate::Error::NotPermitted)
/// when the connected role may not alter `role` (it needs `CREATEROLE`, with `ADMIN` on
/// `role` from PostgreSQL 16, or superuser); [`Error::Backend`](crate::Error::Backend) when
/// the role does not exist.
///
/// # Example
/// ```no_run
/// # async fn f(pool: sqlx::PgPool) -> pgfence::Result<()> {
/// let role = pgfence::table::Ident::new("billing_app")?;
/// pgfence::admin::bound_idle_transactions(&pool, &role, Some(std::time::Duration::from_secs(30))).await?;
/// # Ok(()) }
/// ```
pub async fn bound_idle_transactions<'c, A>(
    conn: A,
    role: &Ident,
    bound: Option<std::time::Duration>,
) -> Result<()>
where
    A: Acquire<'c, Database = Postgres>,
{
    let setting = match bound {
        Some(bound) => {
            let ms = i32::try_from(bound.as_millis())
                .ok()
                .filter(|ms| *ms >= 1)
                .ok_or_else(|| {
                    Error::Invalid(InvalidInput::Duration(format!(
                        "idle-in-transaction timeout {bound:?}: it must be between 1 ms and {} ms",
                        i32::MAX
                    )))
                })?;
            format!("SET idle_in_transaction_session_timeout = {ms}")
        }
        None => "RESET idle_in_transaction_session_timeout".to_owned(),
    };
    let mut conn = conn.acquire().await?;
    let database: String =
        sqlx::query_scalar("SELECT pg_catalog.current_database()::pg_catalog.text")
            .persistent(false)
            .fetch_one(&mut *conn)
            .await?;
    // The role and database names are quoted by `Ident::quoted`; the rest is constant text
    // and a number.
    let sql = format!(
        "ALTER ROLE {} IN DATABASE {} {setting}",
        role.quoted(),
        Ident::new(database)?.quoted()
    );
    sqlx::raw_sql(AssertSqlSafe(sql))
        .execute(&mut *conn)
        .await
        .map_err(crate::error::deploy_time(
            "pgfence grant --idle-in-transaction-timeout",
            "a role with CREATEROLE (and, from PostgreSQL 16, ADMIN on the role) or a superuser",
        ))?;
    Ok(())
}
