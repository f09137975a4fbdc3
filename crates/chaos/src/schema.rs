//! The harness's tables: two counter tables (one guarded, one plain), the history that commits
//! with each write, and the statements the workers and the verification use on them.

use sqlx::{PgConnection, PgPool};

use crate::{ChaosError, LeaselessKind, Mode};

/// The schema the harness creates its tables in.
pub const SCHEMA: &str = "pgfence_chaos";

/// Advisory lock key serialising the harness's schema setup ("chaos").
const SETUP_LOCK_KEY: i64 = 0x0063_6861_6f73;

const SETUP_SQL: &str = r"
CREATE SCHEMA IF NOT EXISTS pgfence_chaos;
CREATE TABLE IF NOT EXISTS pgfence_chaos.cell (
    run     text    NOT NULL,
    id      integer NOT NULL,
    value   bigint  NOT NULL DEFAULT 0,
    version bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (run, id)
);
-- row-claim mode: which write of its unit last wrote the row, and which unit incremented it
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS step integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS last_unit bigint NOT NULL DEFAULT -1;
CREATE TABLE IF NOT EXISTS pgfence_chaos.plain_cell (
    run     text    NOT NULL,
    id      integer NOT NULL,
    value   bigint  NOT NULL DEFAULT 0,
    version bigint  NOT NULL DEFAULT 0,
    PRIMARY KEY (run, id)
);
CREATE TABLE IF NOT EXISTS pgfence_chaos.history (
    run           text        NOT NULL,
    id            integer     NOT NULL,
    version       bigint      NOT NULL,
    token         bigint      NOT NULL,
    value_read    bigint      NOT NULL,
    value_written bigint      NOT NULL,
    unit          bigint      NOT NULL,
    try_no        integer     NOT NULL,
    worker        integer     NOT NULL,
    committed_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (run, id, version)
);
-- multi-statement modes: the transaction of the try, the statement in the unit, what it did
ALTER TABLE pgfence_chaos.history ADD COLUMN IF NOT EXISTS txn integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.history ADD COLUMN IF NOT EXISTS step integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.history ADD COLUMN IF NOT EXISTS kind text NOT NULL DEFAULT 'increment';
-- --coalesce: a write sent through pgfence's Coalescer (its own transaction, shared with other
-- units' writes) carries its history row in these columns; the trigger below inserts it in the
-- coalesced statement itself, so it commits if and only if the write does. w_nonce is new for
-- each such write (other writes leave it as it is, and the trigger does not fire for them).
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_nonce bigint NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_token bigint NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_read bigint NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_try integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_worker integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_txn integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_step integer NOT NULL DEFAULT 0;
ALTER TABLE pgfence_chaos.cell ADD COLUMN IF NOT EXISTS w_kind text NOT NULL DEFAULT '';
ALTER TABLE pgfence_chaos.history ADD COLUMN IF NOT EXISTS coalesced boolean NOT NULL DEFAULT false;
CREATE OR REPLACE FUNCTION pgfence_chaos.record_coalesced() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO pgfence_chaos.history
        (run, id, version, token, value_read, value_written, unit, try_no, worker, txn, step, kind,
         coalesced)
    VALUES (NEW.run, NEW.id, NEW.version, NEW.w_token, NEW.w_read, NEW.value, NEW.last_unit,
            NEW.w_try, NEW.w_worker, NEW.w_txn, NEW.w_step, NEW.w_kind, true);
    RETURN NULL;
END
$$;
CREATE OR REPLACE FUNCTION pgfence_chaos.bump_version() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.version := OLD.version + 1;
    RETURN NEW;
END
$$;
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgname = 'chaos_version' AND tgrelid = 'pgfence_chaos.cell'::regclass) THEN
        CREATE TRIGGER chaos_version BEFORE UPDATE ON pgfence_chaos.cell
            FOR EACH ROW EXECUTE FUNCTION pgfence_chaos.bump_version();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgname = 'chaos_version' AND tgrelid = 'pgfence_chaos.plain_cell'::regclass) THEN
        CREATE TRIGGER chaos_version BEFORE UPDATE ON pgfence_chaos.plain_cell
            FOR EACH ROW EXECUTE FUNCTION pgfence_chaos.bump_version();
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                    WHERE tgname = 'chaos_coalesced' AND tgrelid = 'pgfence_chaos.cell'::regclass) THEN
        CREATE TRIGGER chaos_coalesced AFTER UPDATE ON pgfence_chaos.cell
            FOR EACH ROW WHEN (NEW.w_nonce IS DISTINCT FROM OLD.w_nonce)
            EXECUTE FUNCTION pgfence_chaos.record_coalesced();
    END IF;
END
$$;
";

/// One counter row of the guarded table, as the fenced repository writes it.
#[derive(Clone, Debug)]
pub(crate) struct Cell {
    pub(crate) run: String,
    pub(crate) id: i32,
    pub(crate) value: i64,
}

pgfence::fenced_table!(Cell {
    schema: "pgfence_chaos",
    table: "cell",
    key: (run: String, id: i32),
    columns: [value],
});

/// A counter row of the guarded table as the row-claim mode claims and writes it: the value,
/// which write of the unit wrote it last (`step`), and which unit applied the last increment
/// (`last_unit`, the idempotency key a retry reads back through its claim).
#[derive(Clone, Debug, sqlx::FromRow)]
pub(crate) struct ClaimCell {
    pub(crate) run: String,
    pub(crate) id: i32,
    pub(crate) value: i64,
    pub(crate) step: i32,
    pub(crate) last_unit: i64,
}

pgfence::fenced_table!(ClaimCell {
    schema: "pgfence_chaos",
    table: "cell",
    key: (run: String, id: i32),
    columns: [value, step, last_unit],
});

/// A row-claim update as `--coalesce` sends it through [`pgfence::repository::Coalescer`], outside any
/// transaction of the unit: [`ClaimCell`]'s columns plus the history row it commits with
/// (`w_*`; the table's `chaos_coalesced` trigger inserts it when `w_nonce` changes).
#[derive(Clone, Debug)]
pub(crate) struct CoalescedCell {
    pub(crate) run: String,
    pub(crate) id: i32,
    pub(crate) value: i64,
    pub(crate) step: i32,
    pub(crate) last_unit: i64,
    /// New for every coalesced write of the run.
    pub(crate) w_nonce: i64,
    pub(crate) w_token: i64,
    pub(crate) w_read: i64,
    pub(crate) w_try: i32,
    pub(crate) w_worker: i32,
    pub(crate) w_txn: i32,
    pub(crate) w_step: i32,
    pub(crate) w_kind: String,
}

pgfence::fenced_table!(CoalescedCell {
    schema: "pgfence_chaos",
    table: "cell",
    key: (run: String, id: i32),
    columns: [value, step, last_unit, w_nonce, w_token, w_read, w_try, w_worker, w_txn, w_step, w_kind],
});

/// What a recorded statement did to the row's value (the `kind` column of the history).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Wrote the value it read plus one.
    Increment,
    /// Claimed the row (fence only; the value is unchanged).
    Claim,
    /// Wrote the value it read again (another field changed).
    Rewrite,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Increment => "increment",
            Kind::Claim => "claim",
            Kind::Rewrite => "rewrite",
        }
    }

    /// What the statement adds to the value: one for an increment and for a lease-less write
    /// (a bypass, or an accepted `fence + 1`), nothing for a claim or a rewrite.
    pub(crate) fn delta(kind: &str) -> i64 {
        i64::from(kind == "increment" || is_leaseless(kind))
    }
}

/// Whether a history row's `kind` is a lease-less write's ([`LeaselessKind`]): no lease, no
/// unit of the workers, no token order to keep.
pub(crate) fn is_leaseless(kind: &str) -> bool {
    kind == LeaselessKind::Bypass.as_str() || kind == LeaselessKind::FencePlusOne.as_str()
}

/// A counter table, with the statements run on it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum CounterTable {
    /// `pgfence_chaos.cell`: guarded, written through the fenced repository.
    Guarded,
    /// `pgfence_chaos.plain_cell`: no guard, written with a plain `UPDATE`.
    Plain,
}

impl CounterTable {
    /// The table a mode's workers write.
    pub(crate) fn of(mode: Mode) -> Self {
        match mode {
            Mode::Fenced
            | Mode::FencedMulti
            | Mode::RowFence
            | Mode::RowClaim
            | Mode::Batch
            | Mode::Effects
            | Mode::LeaselessMix
            | Mode::EffectsUnkeyed => CounterTable::Guarded,
            Mode::Unfenced => CounterTable::Plain,
        }
    }

    /// Schema-qualified name.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CounterTable::Guarded => "pgfence_chaos.cell",
            CounterTable::Plain => "pgfence_chaos.plain_cell",
        }
    }

    /// Reads one row's value: `$1` run, `$2` row.
    pub(crate) fn read_sql(self) -> &'static str {
        match self {
            CounterTable::Guarded => {
                "SELECT value FROM pgfence_chaos.cell WHERE run = $1 AND id = $2"
            }
            CounterTable::Plain => {
                "SELECT value FROM pgfence_chaos.plain_cell WHERE run = $1 AND id = $2"
            }
        }
    }

    /// Copies a row's new version and value into the history, in the write's transaction:
    /// `$1` run, `$2` row, `$3` token, `$4` value read, `$5` unit, `$6` try, `$7` worker,
    /// `$8` transaction of the try, `$9` statement of the unit, `$10` [`Kind`].
    pub(crate) fn record_sql(self) -> &'static str {
        match self {
            CounterTable::Guarded => {
                "INSERT INTO pgfence_chaos.history \
                 (run, id, version, token, value_read, value_written, unit, try_no, worker, \
                  txn, step, kind) \
                 SELECT run, id, version, $3, $4, value, $5, $6, $7, $8, $9, $10 \
                 FROM pgfence_chaos.cell WHERE run = $1 AND id = $2"
            }
            CounterTable::Plain => {
                "INSERT INTO pgfence_chaos.history \
                 (run, id, version, token, value_read, value_written, unit, try_no, worker, \
                  txn, step, kind) \
                 SELECT run, id, version, $3, $4, value, $5, $6, $7, $8, $9, $10 \
                 FROM pgfence_chaos.plain_cell WHERE run = $1 AND id = $2"
            }
        }
    }
}

/// Batch mode: copies many rows' new versions and values into the history in one statement,
/// in the batch's transaction: `$1` run, `$2` rows (`int[]`), `$3` token, `$4` values read
/// (`bigint[]`, by row), `$5` unit, `$6` try, `$7` worker, `$8` transaction of the try, `$9`
/// statement of the unit, `$10` [`Kind`]s (`text[]`, by row).
pub(crate) const RECORD_MANY_SQL: &str = "INSERT INTO pgfence_chaos.history \
     (run, id, version, token, value_read, value_written, unit, try_no, worker, txn, step, kind) \
     SELECT c.run, c.id, c.version, $3, r.value_read, c.value, $5, $6, $7, $8, $9, r.kind \
     FROM unnest($2::int[], $4::bigint[], $10::text[]) AS r(id, value_read, kind) \
     JOIN pgfence_chaos.cell c ON c.run = $1 AND c.id = r.id";

/// The unfenced write: `$1` run, `$2` row, `$3` value.
pub(crate) const WRITE_PLAIN: &str =
    "UPDATE pgfence_chaos.plain_cell SET value = $3 WHERE run = $1 AND id = $2";

/// Leaseless mode: the lease-less `fence + 1` (the guard must refuse it): `$1` run, `$2` row.
pub(crate) const WRITE_FENCE_PLUS_ONE: &str = "UPDATE pgfence_chaos.cell \
     SET value = value + 1, fence = fence + 1 WHERE run = $1 AND id = $2";

/// Leaseless mode: the bypass's increment, after `pgfence.bypass(reason)` in its transaction:
/// `$1` run, `$2` row.
pub(crate) const WRITE_BYPASS: &str =
    "UPDATE pgfence_chaos.cell SET value = value + 1 WHERE run = $1 AND id = $2";

/// Leaseless mode: the history row of a lease-less write that went through, in its
/// transaction (the row is still locked by the write, so the value it read is its value - 1):
/// `$1` run, `$2` row, `$3` its id (the `unit`), `$4` writer, `$5` [`LeaselessKind`]. Its
/// token is the row's fence token after the write.
pub(crate) const RECORD_LEASELESS_SQL: &str = "INSERT INTO pgfence_chaos.history \
     (run, id, version, token, value_read, value_written, unit, try_no, worker, txn, step, kind) \
     SELECT run, id, version, fence >> 24, value - 1, value, $3, 0, $4, 0, 0, $5 \
     FROM pgfence_chaos.cell WHERE run = $1 AND id = $2";

/// Leaseless mode: the role the bypasses run as (`SET LOCAL ROLE` in their transaction).
pub(crate) const BYPASS_ROLE: &str = "pgfence_chaos_bypass";

/// Leaseless mode: a role that may bypass the guard ([`pgfence::guard::allow_bypass`]) and write the
/// harness's tables. [`BYPASS_ROLE`] (created `NOLOGIN` if missing) when the connecting role
/// may create it and `SET ROLE` to it — `Some(role)`, the bypasses then `SET LOCAL ROLE` to
/// it; otherwise the connecting role itself (`None`). Superusers are not exempt from the
/// guard: either way the role is allowed explicitly.
pub(crate) async fn setup_bypass_role(admin: &PgPool) -> Result<Option<String>, ChaosError> {
    let mut tx = admin.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(SETUP_LOCK_KEY)
        .execute(&mut *tx)
        .await?;
    let can_create: bool = sqlx::query_scalar(
        "SELECT rolsuper OR rolcreaterole FROM pg_catalog.pg_roles WHERE rolname = current_user",
    )
    .fetch_one(&mut *tx)
    .await?;
    let role = if can_create {
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            // Roles are the cluster's, shared by concurrent setups in other databases
            // (which the advisory lock does not serialise): a lost race is fine.
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = '{BYPASS_ROLE}') THEN
                     BEGIN
                         CREATE ROLE {BYPASS_ROLE} NOLOGIN;
                     EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                     END;
                 END IF;
                 IF NOT pg_catalog.pg_has_role(current_user, '{BYPASS_ROLE}', 'MEMBER') THEN
                     BEGIN
                         GRANT {BYPASS_ROLE} TO CURRENT_USER;
                     EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
                     END;
                 END IF;
             END $$;
             GRANT USAGE ON SCHEMA pgfence_chaos TO {BYPASS_ROLE};
             GRANT SELECT, UPDATE ON pgfence_chaos.cell TO {BYPASS_ROLE};
             GRANT INSERT ON pgfence_chaos.history TO {BYPASS_ROLE};"
        )))
        .execute(&mut *tx)
        .await?;
        BYPASS_ROLE.to_owned()
    } else {
        sqlx::query_scalar("SELECT current_user::text")
            .fetch_one(&mut *tx)
            .await?
    };
    pgfence::guard::allow_bypass(&mut *tx, &role).await?;
    tx.commit().await?;
    Ok(can_create.then_some(role))
}

/// Applies pgfence's migrations if needed, creates the harness's tables (the fenced one
/// guarded) and `rows` fresh counter rows for `run` in both counter tables.
pub(crate) async fn setup(admin: &PgPool, run: &str, rows: i32) -> Result<(), ChaosError> {
    pgfence::admin::migrate(admin).await?;
    let mut tx = admin.begin().await?;
    create_tables(&mut tx).await?;
    for table in [CounterTable::Guarded, CounterTable::Plain] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO {} (run, id) SELECT $1, g FROM generate_series(0, $2 - 1) g",
            table.name()
        )))
        .bind(run)
        .bind(rows)
        .execute(&mut *tx)
        .await?;
    }
    tx.commit().await?;
    Ok(())
}

/// Creates the schema (serialised with concurrent setups) and guards the fenced table.
async fn create_tables(conn: &mut PgConnection) -> Result<(), ChaosError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(SETUP_LOCK_KEY)
        .execute(&mut *conn)
        .await?;
    sqlx::raw_sql(SETUP_SQL).execute(&mut *conn).await?;
    pgfence::guard::guard(&mut *conn, &pgfence::table::TableName::new(SCHEMA, "cell")?).await?;
    Ok(())
}
