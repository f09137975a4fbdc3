//! The single-row statements of a table: update, upsert, delete, claim, fetch, and the
//! statement that explains a write that changed nothing.

use super::*;
use crate::repository::Condition;
use crate::repository::condition::Test;

/// What a table's single-row statements are built from.
pub(super) struct Shape<'a> {
    /// The quoted table.
    pub(super) t: String,
    /// The quoted table as a string literal.
    pub(super) table_literal: String,
    /// The table's OID, as SQL.
    pub(super) rel: String,
    pub(super) keys: &'a [Ident],
    pub(super) cols: &'a [Ident],
    pub(super) audit_lock_timeout_ms: Option<i32>,
}

impl Shape<'_> {
    /// The fence of the key's tombstone, as SQL.
    fn tomb_fence(&self, key_params: &[String]) -> String {
        format!(
            "(SELECT tb.fence FROM pgfence.tombstone tb WHERE tb.rel {EQ} {rel} \
             AND tb.row_key {EQ} {})",
            key_json(key_params),
            rel = self.rel,
        )
    }

    /// `"a" = $n, ` for every data column.
    fn set_cols(&self, col_params: &[String]) -> String {
        self.cols
            .iter()
            .zip(col_params)
            .map(|(c, p)| format!("{} = {p}, ", c.quoted()))
            .collect()
    }

    /// `UPDATE`: the fenced single-row update.
    pub(super) fn update(&self) -> Statement {
        let Self { t, keys, cols, .. } = self;
        let mut p = Params::default();
        let key = p.many(Slot::Key, keys.len());
        let vals = p.many(Slot::Columns, cols.len());
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        p.finish(format!(
            "UPDATE {t} SET {set}\"fence\" = {next} WHERE {km} AND {admit} RETURNING \"fence\"",
            set = self.set_cols(&vals),
            next = next_fence("\"fence\"", &lease),
            km = key_match(keys, &key),
            admit = admits_expected("\"fence\"", &lease, &expected),
        ))
    }

    /// The fenced `INSERT ... ON CONFLICT`; a tombstone of a newer delete refuses it.
    pub(super) fn upsert(&self) -> Statement {
        let Self { t, keys, cols, .. } = self;
        let mut p = Params::default();
        let key = p.many(Slot::Key, keys.len());
        let vals = p.many(Slot::Columns, cols.len());
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        let all_vals: Vec<String> = key.iter().chain(&vals).cloned().collect();
        let (all_cols, conflict_set, key_cols) = upsert_parts(keys, cols);
        p.finish(format!(
            "INSERT INTO {t} AS cur ({cols}, \"fence\") SELECT {vals}, {lease} \
             WHERE coalesce({tomb_admits}, true) OR EXISTS (SELECT 1 FROM {t} WHERE {km}) \
             ON CONFLICT ({keys}) DO UPDATE SET {conflict_set}\"fence\" = {next} \
             WHERE {admit} \
             RETURNING (xmax {EQ} 0) AS inserted, cur.\"fence\"",
            cols = all_cols.join(", "),
            vals = all_vals.join(", "),
            tomb_admits = admits_expected(&self.tomb_fence(&key), &lease, &expected),
            km = key_match(keys, &key),
            keys = key_cols.join(", "),
            next = next_fence("cur.\"fence\"", &lease),
            admit = admits_expected("cur.\"fence\"", &lease, &expected),
        ))
    }

    /// The fenced `DELETE`, leaving a tombstone.
    pub(super) fn delete(&self) -> Statement {
        let Self { t, rel, keys, .. } = self;
        let mut p = Params::default();
        let key = p.many(Slot::Key, keys.len());
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        p.finish(format!(
            "WITH w AS (DELETE FROM {t} WHERE {km} AND {admit} RETURNING {next} AS f), \
             tomb AS (INSERT INTO pgfence.tombstone AS tb (rel, row_key, fence) \
             SELECT {rel}, {kj}, w.f FROM w \
             ON CONFLICT (rel, row_key) DO UPDATE SET fence = GREATEST(tb.fence, EXCLUDED.fence), \
             deleted_at = pg_catalog.now()) \
             SELECT EXISTS (SELECT 1 FROM w), (SELECT w.f FROM w)",
            km = key_match(keys, &key),
            admit = admits_expected("\"fence\"", &lease, &expected),
            next = next_fence("\"fence\"", &lease),
            kj = key_json(&key),
        ))
    }

    /// The claim: only the fence moves; returns the row.
    pub(super) fn claim(&self) -> Statement {
        let Self { t, keys, .. } = self;
        let mut p = Params::default();
        let key = p.many(Slot::Key, keys.len());
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        p.finish(format!(
            "UPDATE {t} SET \"fence\" = {next} WHERE {km} AND {admit} RETURNING *",
            next = next_fence("\"fence\"", &lease),
            km = key_match(keys, &key),
            admit = admits_expected("\"fence\"", &lease, &expected),
        ))
    }

    /// An explaining statement: `current` (the row's fence, NULL when there is no row),
    /// `row_key`, for upsert `tombstone`, and `audit` (see `audit_column`).
    pub(super) fn explain(&self, operation: &str, with_tombstone: bool) -> Statement {
        let Self {
            t,
            table_literal,
            keys,
            audit_lock_timeout_ms,
            ..
        } = self;
        let mut p = Params::default();
        let key = p.many(Slot::Key, keys.len());
        let lease = p.one(Slot::LeaseFence);
        let current = if with_tombstone {
            "coalesce(c.current, c.tombstone)"
        } else {
            "c.current"
        };
        let audit = audit_column(
            &mut p,
            table_literal,
            &lease,
            current,
            operation,
            *audit_lock_timeout_ms,
        );
        let (outer, inner) = if with_tombstone {
            (
                ", c.tombstone",
                format!(", {} AS tombstone", self.tomb_fence(&key)),
            )
        } else {
            ("", String::new())
        };
        p.finish(format!(
            "SELECT c.current, c.row_key{outer}, {audit} AS audit, pgfence.timeline() AS timeline FROM (\
             SELECT (SELECT \"fence\" FROM {t} WHERE {km}) AS current, \
             {kj} AS row_key{inner} OFFSET 0) c",
            km = key_match(keys, &key),
            kj = key_json(&key),
        ))
    }

    /// The row, by key.
    pub(super) fn fetch(&self) -> Statement {
        let Self { t, keys, .. } = self;
        let mut p = Params::default();
        let key = p.many(Slot::Key, keys.len());
        p.finish(format!(
            "SELECT * FROM {t} WHERE {km}",
            km = key_match(keys, &key)
        ))
    }
}

/// The caller's condition as SQL, `("version" OPERATOR(pg_catalog.=) $7 AND "archived_at" IS
/// NULL)`: quoted column names, one placeholder per test with a value ([`Slot::Condition`], in
/// the condition's order), the catalog's operators.
fn condition_sql(p: &mut Params, condition: &Condition) -> String {
    let tests: Vec<String> = condition
        .terms()
        .iter()
        .enumerate()
        .map(|(i, term)| {
            let column = term.column.quoted();
            match &term.test {
                Test::Compare(cmp, _) => format!(
                    "{column} OPERATOR(pg_catalog.{}) {}",
                    cmp.symbol(),
                    p.one(Slot::Condition(i))
                ),
                Test::IsNull => format!("{column} IS NULL"),
                Test::IsNotNull => format!("{column} IS NOT NULL"),
            }
        })
        .collect();
    format!("({})", tests.join(" AND "))
}

/// The statements of a conditional write, built per call (they carry the condition's values).
impl Statements {
    /// The fenced update (every data column, or only those at positions `set`, as
    /// [`Statements::update_columns`]) that applies only where `condition` holds too: binds
    /// as the update does, then the condition's values.
    pub(crate) fn update_if(&self, set: Option<&[usize]>, condition: &Condition) -> Statement {
        let mut p = Params::default();
        let key = p.many(Slot::Key, self.keys.len());
        let assignments: String = match set {
            None => {
                let vals = p.many(Slot::Columns, self.cols.len());
                self.cols
                    .iter()
                    .zip(&vals)
                    .map(|(c, v)| format!("{} = {v}, ", c.quoted()))
                    .collect()
            }
            Some(set) => set
                .iter()
                .filter_map(|&i| self.cols.get(i).map(|c| (i, c)))
                .map(|(i, c)| format!("{} = {}, ", c.quoted(), p.one(Slot::Column(i))))
                .collect(),
        };
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        let cond = condition_sql(&mut p, condition);
        let mut statement = p.finish(format!(
            "UPDATE {t} SET {assignments}\"fence\" = {next} WHERE {km} AND {admit} AND {cond} \
             RETURNING \"fence\"",
            t = self.table,
            next = next_fence("\"fence\"", &lease),
            km = key_match(&self.keys, &key),
            admit = admits_expected("\"fence\"", &lease, &expected),
        ));
        statement.condition = Some(condition.clone());
        statement
    }

    /// The fenced delete (and its tombstone) that applies only where `condition` holds too.
    pub(crate) fn delete_if(&self, condition: &Condition) -> Statement {
        let mut p = Params::default();
        let key = p.many(Slot::Key, self.keys.len());
        let lease = p.lease();
        let expected = p.one(Slot::Expected);
        let cond = condition_sql(&mut p, condition);
        let mut statement = p.finish(format!(
            "WITH w AS (DELETE FROM {t} WHERE {km} AND {admit} AND {cond} RETURNING {next} AS f), \
             tomb AS (INSERT INTO pgfence.tombstone AS tb (rel, row_key, fence) \
             SELECT {rel}, {kj}, w.f FROM w \
             ON CONFLICT (rel, row_key) DO UPDATE SET fence = GREATEST(tb.fence, EXCLUDED.fence), \
             deleted_at = pg_catalog.now()) \
             SELECT EXISTS (SELECT 1 FROM w), (SELECT w.f FROM w)",
            t = self.table,
            rel = self.rel,
            km = key_match(&self.keys, &key),
            admit = admits_expected("\"fence\"", &lease, &expected),
            next = next_fence("\"fence\"", &lease),
            kj = key_json(&key),
        ));
        statement.condition = Some(condition.clone());
        statement
    }

    /// `explain` (a single-row write's explaining statement, whose first slot is the key) with
    /// one more column, `condition`: whether the row meets `condition` now (NULL: no row).
    /// The explaining statement is left as it is, audit and all; its values bind first, then
    /// the condition's.
    pub(crate) fn explain_if(&self, explain: &Statement, condition: &Condition) -> Statement {
        debug_assert_eq!(explain.slots.first(), Some(&Slot::Key));
        let taken = explain
            .slots
            .iter()
            .map(|slot| match slot {
                Slot::Key | Slot::KeyArrays => self.keys.len(),
                Slot::Columns | Slot::ColumnArrays => self.cols.len(),
                _ => 1,
            })
            .sum();
        let mut p = Params {
            next: taken,
            slots: explain.slots.clone(),
        };
        let key: Vec<String> = (1..=self.keys.len()).map(|n| format!("${n}")).collect();
        let cond = condition_sql(&mut p, condition);
        let mut statement = p.finish(format!(
            "SELECT e.*, (SELECT {cond} IS TRUE FROM {t} WHERE {km}) AS condition FROM ({inner}) e",
            t = self.table,
            km = key_match(&self.keys, &key),
            inner = explain.text(),
        ));
        statement.condition = Some(condition.clone());
        statement
    }
}
