//! The repository's SQL, built once per table from validated identifiers.
//!
//! This is the one place where SQL is assembled from user identifiers. Identifiers arrive as
//! [`Ident`]s and are quoted by [`Ident::quoted`]; the table's name appears as a string
//! literal through [`quote_literal`], which refuses what it cannot quote; values are always
//! bind parameters. Every operator, function and type is schema-qualified
//! (`OPERATOR(pg_catalog.=)`, `pg_catalog.jsonb_build_array`), so objects on the caller's
//! `search_path` can never stand in for the catalog's.
//!
//! Placeholders come from one counter, [`Params`], in the order the values are bound: a
//! statement records what it binds ([`Slot`]s) as it hands out `$n`, and
//! [`Statement::bind`] binds in exactly that order.
//!
//! # The fenced predicate
//!
//! Each statement binds the lease once, as its lease fence `L` ([`Fencing::lease_fence`]:
//! token and holder tag, sequence 0). A row's `fence` admits the write when it was written by
//! an older lease (`fence < L & ~0xFFFFFF`, the lease's token with tag and sequence cleared)
//! or by this very lease and not sealed since (`L <= fence < L + 4095`). The write stores `L`
//! for a lease's first write to the row, and the next step of the lease's sequence cycle
//! after that (`L + (fence - L + 2731) % 4095`, [`StoredFence::next_sequence`](crate::token::StoredFence::next_sequence)): the only changes
//! the guard trigger lets through. A fence with the same token and another tag (a duplicate
//! token), a sealed fence (`L + 4095`) and every newer lease's fence are not admitted.
//!
//! None of these numbers is typed here: they are [`StoredFence`](crate::token::StoredFence)'s
//! constants, formatted into the text when the statements are built (inline literals, so the
//! plan is the same as with hand-typed ones), and a test reads them back out of every
//! statement.

mod batch;
mod single;

use sqlx::{AssertSqlSafe, SqlSafeStr, SqlStr};

use crate::audit::{DUPLICATE_REASON, SEALED_REASON};
use crate::ident::{Ident, TableName, quote_literal};
use crate::token::layout::sql as layout;
use crate::{FencedTable, Fencing, Result, table::PgQuery};

/// The catalog's operators, spelled so that `search_path` cannot substitute others.
const EQ: &str = "OPERATOR(pg_catalog.=)";
const LT: &str = "OPERATOR(pg_catalog.<)";
const GE: &str = "OPERATOR(pg_catalog.>=)";
const PLUS: &str = "OPERATOR(pg_catalog.+)";
const AND: &str = "OPERATOR(pg_catalog.&)";
const GT: &str = "OPERATOR(pg_catalog.>)";
const NE: &str = "OPERATOR(pg_catalog.<>)";
const MINUS: &str = "OPERATOR(pg_catalog.-)";
const MOD: &str = "OPERATOR(pg_catalog.%)";

/// A value a statement binds, in the order [`Params`] handed out its placeholders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Slot {
    /// The key columns, one placeholder each.
    Key,
    /// The data columns, one placeholder each.
    Columns,
    /// The lease fence ([`Fencing::lease_fence`]).
    LeaseFence,
    /// The timeline the lease is bound to ([`Fencing::timeline`], `0` when not bound): the
    /// write applies only on that timeline (see [`crate::timeline`]).
    Timeline,
    /// The token itself (for the audit row).
    Token,
    /// The resource the token was issued for (text, may be NULL).
    Resource,
    /// The holder (text, may be NULL).
    Holder,
    /// Whether the statement is a transaction of its own (bool).
    OwnTransaction,
    /// Batch: the key columns as arrays, one placeholder each.
    KeyArrays,
    /// Batch: the data columns as arrays, one placeholder each.
    ColumnArrays,
    /// Batch: the input positions of the rows an explaining statement is about (bigint[]).
    Ordinals,
    /// Coalesced update: each row's lease fence (bigint[]).
    LeaseFences,
    /// Coalesced update: each row's lease timeline (bigint[], `0` when not bound).
    Timelines,
    /// Partial update: one data column, by its position in [`FencedTable::COLUMNS`].
    Column(usize),
    /// The fence the lease last saw on the row (`0`: none of its own): its write applies over
    /// exactly that fence, or over an older lease's ([`crate::token::order`]).
    Expected,
    /// Conditional write: the value of the caller's condition's test at this position
    /// ([`Condition`](crate::repository::Condition), carried by the statement).
    Condition(usize),
}

/// Hands out `$1, $2, ...` in bind order and records what each placeholder binds.
#[derive(Debug, Default)]
struct Params {
    next: usize,
    slots: Vec<Slot>,
}

impl Params {
    fn one(&mut self, slot: Slot) -> String {
        self.slots.push(slot);
        self.next += 1;
        format!("${}", self.next)
    }

    /// The lease of a write: its lease fence and, right after it, its timeline.
    fn lease(&mut self) -> LeaseParams {
        LeaseParams {
            fence: self.one(Slot::LeaseFence),
            timeline: self.one(Slot::Timeline),
        }
    }

    fn many(&mut self, slot: Slot, count: usize) -> Vec<String> {
        self.slots.push(slot);
        (0..count)
            .map(|_| {
                self.next += 1;
                format!("${}", self.next)
            })
            .collect()
    }

    fn finish(self, text: String) -> Statement {
        Statement {
            text: AssertSqlSafe(text).into_sql_str(),
            slots: self.slots,
            condition: None,
        }
    }
}

/// The placeholders of a write's lease: `{}` formats as the lease fence.
struct LeaseParams {
    fence: String,
    timeline: String,
}

impl std::fmt::Display for LeaseParams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.fence)
    }
}

/// One statement's text and what it binds, in order.
#[derive(Debug)]
pub(crate) struct Statement {
    text: SqlStr,
    slots: Vec<Slot>,
    /// A conditional write's condition, whose values its [`Slot::Condition`]s bind (built per
    /// call: `sql/single.rs`).
    condition: Option<crate::repository::Condition>,
}

/// What a statement's [`Slot::Key`] and [`Slot::Columns`] take their values from.
pub(crate) enum Source<'a, T: FencedTable> {
    /// A whole row: its key and data columns.
    Row(&'a T),
    /// A bare key (delete, claim): no data columns.
    Key(&'a T::Key),
}

impl<T: FencedTable> Clone for Source<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T: FencedTable> Copy for Source<'_, T> {}

impl Statement {
    /// The statement's text.
    pub(crate) fn text(&self) -> &str {
        self.text.as_str()
    }

    /// The statement with every value bound, in placeholder order. `own_transaction` says
    /// whether it runs as a transaction of its own (only the client knows).
    pub(crate) fn bind<T: FencedTable>(
        &self,
        source: Source<'_, T>,
        fencing: &Fencing,
        own_transaction: bool,
    ) -> PgQuery {
        self.bind_expecting(source, fencing, own_transaction, 0)
    }

    /// [`Statement::bind`], with the fence the lease expects on the row ([`Slot::Expected`]).
    pub(crate) fn bind_expecting<T: FencedTable>(
        &self,
        source: Source<'_, T>,
        fencing: &Fencing,
        own_transaction: bool,
        expected: i64,
    ) -> PgQuery {
        self.slots
            .iter()
            .fold(sqlx::query(self.text.clone()), |q, slot| {
                match (slot, source) {
                    (Slot::Key, Source::Row(row)) => row.bind_key(q),
                    (Slot::Key, Source::Key(key)) => T::bind_key_value(key, q),
                    (Slot::Columns, Source::Row(row)) => row.bind_columns(q),
                    (Slot::Columns, Source::Key(_)) => q,
                    (Slot::LeaseFence, _) => q.bind(fencing.lease_fence()),
                    (Slot::Timeline, _) => q.bind(fencing.timeline.presented()),
                    (Slot::Token, _) => q.bind(fencing.token.get()),
                    (Slot::Resource, _) => q.bind(fencing.resource.as_ref().map(|r| r.to_string())),
                    (Slot::Holder, _) => q.bind(fencing.holder.clone()),
                    (Slot::OwnTransaction, _) => q.bind(own_transaction),
                    (Slot::Expected, _) => q.bind(expected),
                    (Slot::Condition(i), _) => self.bind_condition(*i, q),
                    // Array slots belong to batch statements (`bind_batch`), single columns
                    // to partial updates (`bind_partial`).
                    (
                        Slot::KeyArrays
                        | Slot::ColumnArrays
                        | Slot::Ordinals
                        | Slot::LeaseFences
                        | Slot::Timelines
                        | Slot::Column(_),
                        _,
                    ) => q,
                }
            })
    }
}

/// What a batch statement's array slots take their values from.
pub(crate) enum BatchSource<'a, T: FencedTable> {
    /// Whole rows: key and data columns.
    Rows(&'a [&'a T]),
    /// Bare keys (delete, claim): no data columns.
    Keys(&'a [&'a T::Key]),
}

impl Statement {
    /// A batch statement with every value bound, in placeholder order; `None` when `T`'s
    /// [`FencedTable`] impl does not bind arrays. `ordinals` are the input positions an
    /// explaining statement reports on.
    pub(crate) fn bind_batch<T: FencedTable>(
        &self,
        source: &BatchSource<'_, T>,
        ordinals: &[i64],
        fencing: &Fencing,
        own_transaction: bool,
    ) -> Option<PgQuery> {
        let mut q = sqlx::query(self.text.clone());
        for slot in &self.slots {
            q = match (slot, source) {
                (Slot::KeyArrays, BatchSource::Rows(rows)) => T::bind_key_arrays(rows, q)?,
                (Slot::KeyArrays, BatchSource::Keys(keys)) => T::bind_key_value_arrays(keys, q)?,
                (Slot::ColumnArrays, BatchSource::Rows(rows)) => T::bind_column_arrays(rows, q)?,
                (Slot::ColumnArrays, BatchSource::Keys(_)) => q,
                (Slot::Ordinals, _) => q.bind(ordinals.to_vec()),
                (Slot::LeaseFence, _) => q.bind(fencing.lease_fence()),
                (Slot::Timeline, _) => q.bind(fencing.timeline.presented()),
                (Slot::Token, _) => q.bind(fencing.token.get()),
                (Slot::Resource, _) => q.bind(fencing.resource.as_ref().map(|r| r.to_string())),
                (Slot::Holder, _) => q.bind(fencing.holder.clone()),
                (Slot::OwnTransaction, _) => q.bind(own_transaction),
                (
                    Slot::Key
                    | Slot::Columns
                    | Slot::Column(_)
                    | Slot::Condition(_)
                    | Slot::LeaseFences
                    | Slot::Timelines
                    | Slot::Expected,
                    _,
                ) => q,
            };
        }
        Some(q)
    }

    /// The coalesced update ([`BatchStatements::coalesced_update`]) with every value bound:
    /// the rows' key and data columns as arrays, and each row's lease fence and timeline.
    /// `None` when `T`'s [`FencedTable`] impl does not bind arrays.
    pub(crate) fn bind_coalesced<T: FencedTable>(
        &self,
        rows: &[&T],
        fences: Vec<i64>,
        timelines: Vec<i64>,
    ) -> Option<PgQuery> {
        let mut q = sqlx::query(self.text.clone());
        let (mut fences, mut timelines) = (Some(fences), Some(timelines));
        for slot in &self.slots {
            q = match slot {
                Slot::KeyArrays => T::bind_key_arrays(rows, q)?,
                Slot::ColumnArrays => T::bind_column_arrays(rows, q)?,
                Slot::LeaseFences => q.bind(fences.take()?),
                Slot::Timelines => q.bind(timelines.take()?),
                _ => return None,
            };
        }
        Some(q)
    }

    /// A partial update ([`Statements::update_columns`]) with every value bound: the row's
    /// key, the columns it sets, one by one, and the lease. `None` when `T`'s
    /// [`FencedTable`] impl does not bind single columns.
    pub(crate) fn bind_partial<T: FencedTable>(
        &self,
        row: &T,
        fencing: &Fencing,
        expected: i64,
    ) -> Option<PgQuery> {
        let mut q = sqlx::query(self.text.clone());
        for slot in &self.slots {
            q = match slot {
                Slot::Key => row.bind_key(q),
                Slot::Columns => row.bind_columns(q),
                Slot::Column(i) => row.bind_column(T::COLUMNS.get(*i)?, q)?,
                Slot::LeaseFence => q.bind(fencing.lease_fence()),
                Slot::Timeline => q.bind(fencing.timeline.presented()),
                Slot::Token => q.bind(fencing.token.get()),
                Slot::Resource => q.bind(fencing.resource.as_ref().map(|r| r.to_string())),
                Slot::Holder => q.bind(fencing.holder.clone()),
                Slot::OwnTransaction => q.bind(false),
                Slot::Expected => q.bind(expected),
                Slot::Condition(i) => self.bind_condition(*i, q),
                Slot::KeyArrays
                | Slot::ColumnArrays
                | Slot::Ordinals
                | Slot::LeaseFences
                | Slot::Timelines => q,
            };
        }
        Some(q)
    }

    /// Binds the value of the statement's condition's test `i` (nothing for a test without
    /// a value; the builder hands out a slot only for those that have one).
    fn bind_condition(&self, i: usize, q: PgQuery) -> PgQuery {
        use crate::repository::condition::Test;
        match self.condition.as_ref().and_then(|c| c.terms().get(i)) {
            Some(term) => match &term.test {
                Test::Compare(_, value) => value.bind(q),
                Test::IsNull | Test::IsNotNull => q,
            },
            None => q,
        }
    }

    /// The condition of a conditional write's statement (`None` for every other).
    pub(crate) fn condition(&self) -> Option<&crate::repository::Condition> {
        self.condition.as_ref()
    }

    /// A statement that binds only a key (`fetch`).
    pub(crate) fn bind_key<T: FencedTable>(&self, key: &T::Key) -> PgQuery {
        self.slots
            .iter()
            .fold(sqlx::query(self.text.clone()), |q, slot| match slot {
                Slot::Key => T::bind_key_value(key, q),
                _ => q,
            })
    }
}

/// The SQL of one table: each write, the claim, the statements that explain a write that
/// changed nothing, and their batch forms.
#[derive(Debug)]
pub(crate) struct Statements {
    /// The quoted table, key and data columns, for statements built later
    /// ([`Statements::update_columns`]).
    table: String,
    /// The table's OID, as SQL (the tombstone's `rel`), for statements built later.
    rel: String,
    keys: Vec<Ident>,
    cols: Vec<Ident>,
    pub update: Statement,
    pub upsert: Statement,
    pub delete: Statement,
    pub claim: Statement,
    pub explain_update: Statement,
    pub explain_upsert: Statement,
    pub explain_delete: Statement,
    /// As `explain_update`, audited as operation `claim`.
    pub explain_claim: Statement,
    /// `SELECT * FROM <table> WHERE <key>`: a plain read, no fence.
    pub fetch: Statement,
    pub batch: BatchStatements,
}

/// The batch forms: one statement per batch, the rows passed as one array per column and
/// expanded with `ROWS FROM (unnest(..), ..) WITH ORDINALITY`, so the text does not depend on
/// the batch's size and is prepared once. Each returns, for the rows it applied, their input
/// position (`ord`, 1-based) — and for upsert whether the row was inserted — and, instead of
/// writing anything, the keys that appear twice in the batch (`dup`). The explaining
/// statement takes the keys and positions of the rows that were not applied.
#[derive(Debug)]
pub(crate) struct BatchStatements {
    pub update: Statement,
    pub upsert: Statement,
    pub delete: Statement,
    pub claim: Statement,
    pub explain_update: Statement,
    pub explain_upsert: Statement,
    pub explain_delete: Statement,
    pub explain_claim: Statement,
    /// Single-row updates of many leases in one statement
    /// ([`Coalescer`](crate::repository::Coalescer)): each row carries its own lease fence
    /// and timeline; a key named twice is written once (its first row), the others are left
    /// for their callers to send alone.
    pub coalesced_update: Statement,
}

/// Whether a stored fence admits a write of `lease`: by its lease fence, and only on the
/// timeline the lease is bound to ([`on_timeline`]).
fn admits(fence: &str, lease: &LeaseParams) -> String {
    let l = &lease.fence;
    let (token_mask, sealed) = (layout::token_mask(), layout::sealed_sequence());
    format!(
        "(({fence} {LT} ({l} {AND} {token_mask}) \
         OR ({fence} {GE} {l} AND {fence} {LT} ({l} {PLUS} {sealed}))) AND {})",
        on_timeline(&lease.timeline)
    )
}

/// Whether a stored fence admits a lease's write that expects `expected` there: an older
/// lease's fence, or exactly the fence this lease last saw ([`crate::token::order`]); only on
/// the timeline the lease is bound to.
fn admits_expected(fence: &str, lease: &LeaseParams, expected: &str) -> String {
    let l = &lease.fence;
    let token_mask = layout::token_mask();
    format!(
        "(({fence} {LT} ({l} {AND} {token_mask}) OR {fence} {EQ} {expected}) AND {})",
        on_timeline(&lease.timeline)
    )
}

/// Whether the database is on the timeline `timeline` binds (`0`: a lease not bound, which
/// is not checked). `pgfence.timeline()` is a SQL function the planner inlines: one read of
/// the WAL insert position per statement.
fn on_timeline(timeline: &str) -> String {
    format!(
        "({timeline}::pg_catalog.int8 {EQ} 0 \
         OR {timeline}::pg_catalog.int8 {EQ} pgfence.timeline())"
    )
}

/// The fence an admitted write stores: `L` over an older lease's fence, the lease's next
/// sequence step over its own.
fn next_fence(fence: &str, lease: &impl std::fmt::Display) -> String {
    let (step, sealed) = (layout::sequence_step(), layout::sealed_sequence());
    format!(
        "CASE WHEN {fence} {LT} {lease} THEN {lease} \
         ELSE {lease} {PLUS} (({fence} {MINUS} {lease} {PLUS} {step}) {MOD} {sealed}) END"
    )
}

/// Whether a stored fence means the lease was rejected: a newer lease, the same token
/// presented by another holder, or this lease's fence sealed. (Not: older, or this lease's
/// own.)
fn rejects(fence: &str, lease: &str) -> String {
    let (token_mask, sealed) = (layout::token_mask(), layout::sealed_sequence());
    format!(
        "{fence} {GE} ({lease} {AND} {token_mask}) \
         AND NOT ({fence} {GE} {lease} AND {fence} {LT} ({lease} {PLUS} {sealed}))"
    )
}

/// The identifier parts of an upsert: every column (keys first), the `ON CONFLICT` SET list
/// for the data columns, and the key columns.
fn upsert_parts(keys: &[Ident], cols: &[Ident]) -> (Vec<String>, String, Vec<String>) {
    let all_cols = keys.iter().chain(cols).map(Ident::quoted).collect();
    let conflict_set = cols
        .iter()
        .map(|c| format!("{0} = EXCLUDED.{0}, ", c.quoted()))
        .collect();
    let key_cols = keys.iter().map(Ident::quoted).collect();
    (all_cols, conflict_set, key_cols)
}

/// `a = $1 AND b = $2`.
fn key_match(keys: &[Ident], params: &[String]) -> String {
    keys.iter()
        .zip(params)
        .map(|(c, p)| format!("{} {EQ} {p}", c.quoted()))
        .collect::<Vec<_>>()
        .join(" AND ")
}

/// The key as JSON text (`["A-1"]`), as stored in tombstones and the audit trail.
fn key_json(params: &[String]) -> String {
    format!(
        "pg_catalog.jsonb_build_array({})::pg_catalog.text",
        params.join(", ")
    )
}

impl Statements {
    /// Builds the statements for `table` with key columns `keys` and data columns `cols`.
    /// `audit_lock_timeout_ms` is `Some` when rejections of statements that are their own
    /// transaction write their audit row in the explaining statement.
    ///
    /// # Errors
    /// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier) when the table's name cannot be quoted as a literal.
    pub(crate) fn build(
        table: &TableName,
        keys: &[Ident],
        cols: &[Ident],
        audit_lock_timeout_ms: Option<i32>,
    ) -> Result<Self> {
        let t = table.quoted();
        let table_literal = quote_literal(&t)?;
        let rel = format!("{table_literal}::pg_catalog.regclass::pg_catalog.oid");
        let shape = single::Shape {
            rel: rel.clone(),
            t: t.clone(),
            table_literal: table_literal.clone(),
            keys,
            cols,
            audit_lock_timeout_ms,
        };
        Ok(Self {
            table: t.clone(),
            rel,
            keys: keys.to_vec(),
            cols: cols.to_vec(),
            fetch: shape.fetch(),
            update: shape.update(),
            upsert: shape.upsert(),
            delete: shape.delete(),
            claim: shape.claim(),
            explain_update: shape.explain("update", false),
            explain_upsert: shape.explain("upsert", true),
            explain_delete: shape.explain("delete", false),
            explain_claim: shape.explain("claim", false),
            batch: BatchStatements::build(&t, &table_literal, keys, cols, audit_lock_timeout_ms),
        })
    }
}

impl Statements {
    /// The update statement that sets only the data columns at positions `set` (sorted,
    /// distinct, in range): the same fenced predicate and next fence as [`Statements::update`],
    /// binding the key, each column of `set` ([`Slot::Column`]), then the lease.
    pub(crate) fn update_columns(&self, set: &[usize]) -> Statement {
        let mut p = Params::default();
        let key = p.many(Slot::Key, self.keys.len());
        let assignments: String = set
            .iter()
            .filter_map(|&i| self.cols.get(i).map(|c| (i, c)))
            .map(|(i, c)| format!("{} = {}, ", c.quoted(), p.one(Slot::Column(i))))
            .collect();
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        p.finish(format!(
            "UPDATE {t} SET {assignments}\"fence\" = {next} WHERE {km} AND {admit} \
             RETURNING \"fence\"",
            t = self.table,
            next = next_fence("\"fence\"", &lease),
            km = key_match(&self.keys, &key),
            admit = admits_expected("\"fence\"", &lease, &expected),
        ))
    }
}

/// `SELECT "a", "b" FROM <table>`: prepared (never run) by
/// [`Repository::verify`](crate::Repository::verify), to learn the columns' types exactly as
/// sqlx sees them when it reads a row.
pub(crate) fn select_columns(table: &TableName, columns: &[Ident]) -> SqlStr {
    let list: Vec<String> = columns.iter().map(Ident::quoted).collect();
    AssertSqlSafe(format!(
        "SELECT {} FROM {}",
        list.join(", "),
        table.quoted()
    ))
    .into_sql_str()
}

/// The `audit` column of an explaining statement. For a rejection (a newer lease's fence, or
/// the same token from another holder) of a statement that is its own transaction, it calls
/// `pgfence.record_rejection`, which writes the audit row in that same statement and returns
/// `''` (if it cannot, the statement fails and is explained again without it); NULL
/// otherwise, and then the `Auditor` writes the row through its own pool.
/// (The reasons are constants without quotes: they are pasted as SQL literals.)
fn audit_column(
    p: &mut Params,
    table_literal: &str,
    lease: &str,
    current: &str,
    operation: &str,
    lock_timeout_ms: Option<i32>,
) -> String {
    let Some(ms) = lock_timeout_ms else {
        return "NULL::pg_catalog.text".to_owned();
    };
    let token = p.one(Slot::Token);
    let resource = p.one(Slot::Resource);
    let holder = p.one(Slot::Holder);
    let own_transaction = p.one(Slot::OwnTransaction);
    // A lease bound to another timeline than the database's is refused for the failover,
    // and audited once, with that reason, by the library (`Rejecting::failover`): the
    // statement writes no row of its own for it.
    let timeline = p.one(Slot::Timeline);
    format!(
        "CASE WHEN {own_transaction}::pg_catalog.bool AND {rejected} \
         AND ({timeline}::pg_catalog.int8 {EQ} 0 OR {timeline}::pg_catalog.int8 {EQ} pgfence.timeline()) \
         THEN pgfence.record_rejection({resource}::pg_catalog.text, {table_literal}, c.row_key, \
         {token}::pg_catalog.int8, {current_token}, {holder}::pg_catalog.text, '{operation}', {ms}, \
         {current_token} {GT} 0 AND ({current} {AND} {counter}) {NE} ({lease} {AND} {counter}), \
         CASE WHEN {current} {EQ} ({lease} {PLUS} {sealed}) THEN '{SEALED_REASON}' \
         WHEN {current_token} {EQ} {lease_token} AND ({current} {AND} {counter}) {EQ} ({lease} {AND} {counter}) \
         THEN '{DUPLICATE_REASON}' END) END",
        rejected = rejects(current, lease),
        current_token = layout::token_of(current),
        lease_token = layout::token_of(lease),
        counter = layout::counter_mask(),
        sealed = layout::sealed_sequence(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_reasons_paste_as_literals() {
        for reason in [DUPLICATE_REASON, SEALED_REASON] {
            assert!(!reason.contains(['\'', '\\', '$']), "{reason}");
        }
    }

    fn build(table: &str, keys: &[&str], cols: &[&str]) -> Statements {
        let idents = |names: &[&str]| names.iter().map(|n| Ident::new(*n).unwrap()).collect();
        let keys: Vec<Ident> = idents(keys);
        let cols: Vec<Ident> = idents(cols);
        Statements::build(&TableName::parse(table).unwrap(), &keys, &cols, Some(2000)).unwrap()
    }

    #[test]
    fn one_key_update_numbers_placeholders_in_bind_order() {
        let s = build("inventory", &["sku"], &["payload", "qty"]);
        assert_eq!(
            s.update.slots,
            [
                Slot::Key,
                Slot::Columns,
                Slot::LeaseFence,
                Slot::Timeline,
                Slot::Expected
            ]
        );
        assert_eq!(
            s.update.text(),
            "UPDATE \"public\".\"inventory\" SET \"payload\" = $2, \"qty\" = $3, \
             \"fence\" = CASE WHEN \"fence\" OPERATOR(pg_catalog.<) $4 THEN $4 ELSE $4 \
             OPERATOR(pg_catalog.+) ((\"fence\" OPERATOR(pg_catalog.-) $4 OPERATOR(pg_catalog.+) \
             2731::pg_catalog.int8) OPERATOR(pg_catalog.%) 4095::pg_catalog.int8) END \
             WHERE \"sku\" OPERATOR(pg_catalog.=) $1 AND ((\"fence\" OPERATOR(pg_catalog.<) \
             ($4 OPERATOR(pg_catalog.&) (-16777216)::pg_catalog.int8) OR \"fence\" \
             OPERATOR(pg_catalog.=) $6) AND ($5::pg_catalog.int8 \
             OPERATOR(pg_catalog.=) 0 OR $5::pg_catalog.int8 OPERATOR(pg_catalog.=) \
             pgfence.timeline())) RETURNING \"fence\""
        );
        assert_eq!(
            s.claim.text(),
            "UPDATE \"public\".\"inventory\" SET \"fence\" = CASE WHEN \"fence\" \
             OPERATOR(pg_catalog.<) $2 THEN $2 ELSE $2 OPERATOR(pg_catalog.+) ((\"fence\" \
             OPERATOR(pg_catalog.-) $2 OPERATOR(pg_catalog.+) 2731::pg_catalog.int8) \
             OPERATOR(pg_catalog.%) 4095::pg_catalog.int8) END WHERE \"sku\" \
             OPERATOR(pg_catalog.=) $1 AND ((\"fence\" OPERATOR(pg_catalog.<) ($2 \
             OPERATOR(pg_catalog.&) (-16777216)::pg_catalog.int8) OR \"fence\" \
             OPERATOR(pg_catalog.=) $4) AND ($3::pg_catalog.int8 \
             OPERATOR(pg_catalog.=) 0 OR $3::pg_catalog.int8 OPERATOR(pg_catalog.=) \
             pgfence.timeline())) RETURNING *"
        );
    }

    #[test]
    fn two_key_statements_bind_every_placeholder_once() {
        let s = build("billing.ledger_line", &["batch", "line"], &["amount"]);
        let highest = |text: &str| {
            (1..=20)
                .rev()
                .find(|n| text.contains(&format!("${n}")))
                .unwrap_or(0)
        };
        // update: 2 keys, 1 column, the lease, its timeline and the fence it expects.
        assert_eq!(highest(s.update.text()), 6);
        assert!(s.update.text().contains(
            "\"batch\" OPERATOR(pg_catalog.=) $1 AND \"line\" OPERATOR(pg_catalog.=) $2"
        ));
        assert!(s.update.text().contains("\"amount\" = $3"));
        // upsert inserts keys and column in declaration order, then the lease.
        assert!(
            s.upsert
                .text()
                .contains("(\"batch\", \"line\", \"amount\", \"fence\") SELECT $1, $2, $3, $4")
        );
        // delete and claim: keys, then the lease.
        assert_eq!(highest(s.delete.text()), 5);
        assert_eq!(
            s.delete.slots,
            [Slot::Key, Slot::LeaseFence, Slot::Timeline, Slot::Expected]
        );
        // explaining statements: keys, lease, then the audit context.
        assert_eq!(
            s.explain_update.slots,
            [
                Slot::Key,
                Slot::LeaseFence,
                Slot::Token,
                Slot::Resource,
                Slot::Holder,
                Slot::OwnTransaction,
                Slot::Timeline
            ]
        );
        assert_eq!(highest(s.explain_upsert.text()), 8);
        assert!(s.explain_update.text().contains("$7::pg_catalog.bool"));
    }

    #[test]
    fn batch_statements_bind_one_array_per_column_then_the_lease() {
        let s = build("billing.ledger_line", &["batch", "line"], &["amount"]);
        let b = &s.batch;
        assert_eq!(
            b.update.slots,
            [
                Slot::KeyArrays,
                Slot::ColumnArrays,
                Slot::LeaseFence,
                Slot::Timeline
            ]
        );
        assert!(b.update.text().starts_with(
            "WITH i AS (SELECT * FROM ROWS FROM (pg_catalog.unnest($1), pg_catalog.unnest($2), \
             pg_catalog.unnest($3)) WITH ORDINALITY AS i(k0, k1, c0, ord))"
        ));
        assert!(b.update.text().contains("\"amount\" = i.c0, \"fence\" = CASE WHEN tgt.\"fence\" OPERATOR(pg_catalog.<) $4 THEN $4"));
        assert_eq!(
            b.delete.slots,
            [Slot::KeyArrays, Slot::LeaseFence, Slot::Timeline]
        );
        assert!(b.delete.text().contains(
            "tgt.\"batch\" OPERATOR(pg_catalog.=) i.k0 AND tgt.\"line\" OPERATOR(pg_catalog.=) i.k1"
        ));
        assert_eq!(
            b.explain_update.slots,
            [
                Slot::KeyArrays,
                Slot::Ordinals,
                Slot::LeaseFence,
                Slot::Token,
                Slot::Resource,
                Slot::Holder,
                Slot::OwnTransaction,
                Slot::Timeline
            ]
        );
        assert!(
            b.explain_update
                .text()
                .contains("pg_catalog.unnest($3)) AS i(k0, k1, ord)")
        );
    }

    #[test]
    fn a_partial_update_is_the_update_with_fewer_assignments() {
        let s = build("inventory", &["sku"], &["payload", "qty"]);
        // Every column: the very text of `update`.
        let all = s.update_columns(&[0, 1]);
        assert_eq!(all.text(), s.update.text());
        assert_eq!(
            all.slots,
            [
                Slot::Key,
                Slot::Column(0),
                Slot::Column(1),
                Slot::LeaseFence,
                Slot::Timeline,
                Slot::Expected
            ]
        );
        // One column: the same predicate and next fence, one assignment.
        let qty = s.update_columns(&[1]);
        assert_eq!(
            qty.slots,
            [
                Slot::Key,
                Slot::Column(1),
                Slot::LeaseFence,
                Slot::Timeline,
                Slot::Expected
            ]
        );
        assert_eq!(
            qty.text(),
            s.update
                .text()
                .replace("\"payload\" = $2, \"qty\" = $3", "\"qty\" = $2")
                .replace("$4", "$3")
                .replace("$5", "$4")
                .replace("$6", "$5")
        );
        assert_eq!(
            s.fetch.text(),
            "SELECT * FROM \"public\".\"inventory\" WHERE \"sku\" OPERATOR(pg_catalog.=) $1"
        );
        assert_eq!(s.fetch.slots, [Slot::Key]);
    }

    /// Every statement of a table, single-row and batch, with and without in-statement audit.
    fn every_statement() -> Vec<String> {
        let mut texts = Vec::new();
        for audit in [Some(2000), None] {
            let keys = [Ident::new("batch").unwrap(), Ident::new("line").unwrap()];
            let cols = [Ident::new("amount").unwrap()];
            let s =
                Statements::build(&TableName::parse("t").unwrap(), &keys, &cols, audit).unwrap();
            let b = &s.batch;
            for st in [
                &s.update,
                &s.upsert,
                &s.delete,
                &s.claim,
                &s.explain_update,
                &s.explain_upsert,
                &s.explain_delete,
                &s.explain_claim,
                &b.update,
                &b.upsert,
                &b.delete,
                &b.claim,
                &b.explain_update,
                &b.explain_upsert,
                &b.explain_delete,
                &b.explain_claim,
            ] {
                texts.push(st.text().to_owned());
            }
            texts.push(s.update_columns(&[0]).text().to_owned());
            let cond = crate::repository::Condition::eq("amount", 1_i64).unwrap();
            texts.push(s.update_if(None, &cond).text().to_owned());
            texts.push(s.update_if(Some(&[0]), &cond).text().to_owned());
            texts.push(s.delete_if(&cond).text().to_owned());
            texts.push(s.explain_if(&s.explain_update, &cond).text().to_owned());
        }
        texts
    }

    /// The numbers written before `suffix` in `text` (`-16777216` in `(-16777216)::...`).
    fn numbers_before(text: &str, suffix: &str) -> Vec<i64> {
        text.match_indices(suffix)
            .filter_map(|(at, _)| {
                let head = text[..at].trim_end_matches(')');
                let start = head
                    .rfind(|c: char| !(c.is_ascii_digit() || c == '-'))
                    .map_or(0, |i| i + 1);
                let digits = &head[start..];
                // `$4::pg_catalog.int8` is a placeholder, not a literal.
                (!digits.is_empty() && !head[..start].ends_with('$'))
                    .then(|| digits.parse().unwrap())
            })
            .collect()
    }

    /// The numbers written after `prefix` in `text` (`24` in `>> 24`).
    fn numbers_after(text: &str, prefix: &str) -> Vec<i64> {
        text.match_indices(prefix)
            .map(|(at, _)| {
                let tail = &text[at + prefix.len()..];
                let end = tail
                    .find(|c: char| !c.is_ascii_digit())
                    .unwrap_or(tail.len());
                tail[..end].parse().unwrap()
            })
            .collect()
    }

    #[test]
    fn every_number_in_the_statements_is_a_layout_constant() {
        use crate::token::StoredFence as F;
        let layout = [
            F::TOKEN_MASK,
            F::SEALED_SEQUENCE,
            F::SEQUENCE_STEP,
            F::COUNTER_MASK,
        ];
        let mut seen = std::collections::BTreeSet::new();
        for text in every_statement() {
            for n in numbers_before(&text, "::pg_catalog.int8") {
                assert!(
                    layout.contains(&n),
                    "{n} is not a layout constant in {text}"
                );
                seen.insert(n);
            }
            for n in numbers_after(&text, "OPERATOR(pg_catalog.>>) ") {
                assert_eq!(n, i64::from(F::TOKEN_SHIFT), "{text}");
                seen.insert(n);
            }
            for hand_typed in ["16777215", "0xFFFFFF", ">> 24", "<< 24", " 4096"] {
                assert!(!text.contains(hand_typed), "{hand_typed} in {text}");
            }
        }
        // ...and every constant is used: the predicate, the cycle and the audit's counter.
        let mut expected: std::collections::BTreeSet<i64> = layout.into_iter().collect();
        expected.insert(i64::from(F::TOKEN_SHIFT));
        assert_eq!(seen, expected);
    }

    #[test]
    fn hostile_names_stay_quoted() {
        let s = build(
            "\"we'ird\"\"; DROP TABLE x; --\".\"t\"",
            &["k\"); --"],
            &["v'"],
        );
        let text = s.explain_update.text();
        // The identifier is double-quoted with inner quotes doubled...
        assert!(
            s.update
                .text()
                .starts_with("UPDATE \"we'ird\"\"; DROP TABLE x; --\".\"t\" SET \"v'\" = $2")
        );
        assert!(
            s.update
                .text()
                .contains("\"k\"\"); --\" OPERATOR(pg_catalog.=) $1")
        );
        // ...and as a literal, single quotes are doubled too.
        assert!(
            text.contains("'\"we''ird\"\"; DROP TABLE x; --\".\"t\"'"),
            "{text}"
        );
    }

    #[test]
    fn a_conditional_write_is_the_write_and_its_condition_binds_last() {
        use crate::repository::Condition;
        let s = build("inventory", &["sku"], &["payload", "qty"]);
        let cond = Condition::eq("ver\"sion", 7_i64)
            .unwrap()
            .and(Condition::is_null("archived_at").unwrap())
            .and(Condition::le("qty", 3_i32).unwrap());
        let update = s.update_if(None, &cond);
        assert_eq!(
            update.text(),
            format!(
                "{} AND (\"ver\"\"sion\" OPERATOR(pg_catalog.=) $7 AND \"archived_at\" IS NULL \
                 AND \"qty\" OPERATOR(pg_catalog.<=) $8) RETURNING \"fence\"",
                s.update.text().trim_end_matches(" RETURNING \"fence\"")
            )
        );
        assert_eq!(
            update.slots,
            [
                Slot::Key,
                Slot::Columns,
                Slot::LeaseFence,
                Slot::Timeline,
                Slot::Expected,
                Slot::Condition(0),
                Slot::Condition(2)
            ]
        );
        let partial = s.update_if(Some(&[1]), &cond);
        assert!(partial.text().starts_with(&format!(
                    "{} AND (",
                    s.update_columns(&[1])
                        .text()
                        .trim_end_matches(" RETURNING \"fence\"")
                )));
        assert!(
            partial.text().ends_with(
                "$6 AND \"archived_at\" IS NULL AND \"qty\" OPERATOR(pg_catalog.<=) $7) RETURNING \"fence\""
            )
        );
        let delete = s.delete_if(&cond);
        assert!(
            delete
                .text()
                .contains("pgfence.timeline())) AND (\"ver\"\"sion\" OPERATOR(pg_catalog.=) $5 ")
        );
        // The explaining statement is wrapped whole; the condition's values follow its own.
        let explain = s.explain_if(&s.explain_update, &cond);
        assert_eq!(
            explain.text(),
            format!(
                "SELECT e.*, (SELECT (\"ver\"\"sion\" OPERATOR(pg_catalog.=) $8 AND \"archived_at\" \
                 IS NULL AND \"qty\" OPERATOR(pg_catalog.<=) $9) IS TRUE FROM \"public\".\"inventory\" \
                 WHERE \"sku\" OPERATOR(pg_catalog.=) $1) AS condition FROM ({}) e",
                s.explain_update.text()
            )
        );
        assert_eq!(explain.slots.len(), s.explain_update.slots.len() + 2);
        assert!(explain.condition().is_some() && s.explain_update.condition().is_none());
    }

    #[test]
    fn without_statement_audit_the_explaining_statement_binds_no_context() {
        let keys = [Ident::new("id").unwrap()];
        let s = Statements::build(&TableName::parse("t").unwrap(), &keys, &[], None).unwrap();
        assert_eq!(s.explain_delete.slots, [Slot::Key, Slot::LeaseFence]);
        assert!(
            s.explain_delete
                .text()
                .contains("NULL::pg_catalog.text AS audit")
        );
    }
}
