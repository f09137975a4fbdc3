//! A table's batch statements: one array per column, one statement whatever the batch's
//! size, and the statement that explains the rows not applied.

use super::*;

impl BatchStatements {
    pub(super) fn build(
        t: &str,
        table_literal: &str,
        keys: &[Ident],
        cols: &[Ident],
        audit_lock_timeout_ms: Option<i32>,
    ) -> Self {
        let shape = BatchShape {
            // Input columns get generated names (k0.., c0.., ord), so no user column can clash.
            kn: (0..keys.len()).map(|i| format!("i.k{i}")).collect(),
            cn: (0..cols.len()).map(|i| format!("i.c{i}")).collect(),
            rel: format!("{table_literal}::pg_catalog.regclass::pg_catalog.oid"),
            t,
            table_literal,
            keys,
            cols,
            audit_lock_timeout_ms,
        };
        Self {
            update: shape.update(),
            upsert: shape.upsert(),
            delete: shape.delete(),
            claim: shape.claim(),
            explain_update: shape.explain("update", false),
            explain_upsert: shape.explain("upsert", true),
            explain_delete: shape.explain("delete", false),
            explain_claim: shape.explain("claim", false),
            coalesced_update: shape.coalesced_update(),
        }
    }
}

/// A batch statement's result rows: applied rows' positions, then the keys named twice.
const APPLIED_OR_DUP: &str = "SELECT w.ord, NULL::pg_catalog.text AS dup FROM w \
     UNION ALL SELECT NULL, dup.key FROM dup";
/// A batch that names a key twice writes nothing.
const NO_DUP: &str = "NOT EXISTS (SELECT 1 FROM dup)";

/// What a table's batch statements are built from.
struct BatchShape<'a> {
    /// The input's key columns (`i.k0`..).
    kn: Vec<String>,
    /// The input's data columns (`i.c0`..).
    cn: Vec<String>,
    /// The table's OID, as SQL.
    rel: String,
    /// The quoted table.
    t: &'a str,
    /// The quoted table as a string literal.
    table_literal: &'a str,
    keys: &'a [Ident],
    cols: &'a [Ident],
    audit_lock_timeout_ms: Option<i32>,
}

impl BatchShape<'_> {
    /// The input CTEs: `i` (the arrays unnested, with their ordinality) and `dup` (keys named
    /// twice).
    fn input(&self, p: &mut Params, with_cols: bool) -> String {
        let Self { keys, cols, kn, .. } = self;
        let mut arrays = p.many(Slot::KeyArrays, keys.len());
        let mut names: Vec<String> = (0..keys.len()).map(|i| format!("k{i}")).collect();
        if with_cols {
            arrays.extend(p.many(Slot::ColumnArrays, cols.len()));
            names.extend((0..cols.len()).map(|i| format!("c{i}")));
        }
        let unnests: Vec<String> = arrays
            .iter()
            .map(|a| format!("pg_catalog.unnest({a})"))
            .collect();
        format!(
            "i AS (SELECT * FROM ROWS FROM ({}) WITH ORDINALITY AS i({}, ord)), \
             dup AS (SELECT {kj} AS key FROM i GROUP BY {k} \
             HAVING pg_catalog.count(*) OPERATOR(pg_catalog.>) 1)",
            unnests.join(", "),
            names.join(", "),
            kj = key_json(kn),
            k = kn.join(", "),
        )
    }

    /// `alias`'s key columns equal the input's.
    fn matches(&self, alias: &str) -> String {
        let Self { keys, kn, .. } = self;
        keys.iter()
            .zip(kn)
            .map(|(c, i)| format!("{alias}.{} {EQ} {i}", c.quoted()))
            .collect::<Vec<_>>()
            .join(" AND ")
    }

    /// `"a" = i.c0, ` for every data column.
    fn set_cols(&self) -> String {
        self.cols
            .iter()
            .zip(&self.cn)
            .map(|(c, i)| format!("{} = {i}, ", c.quoted()))
            .collect()
    }

    /// The batch update.
    fn update(&self) -> Statement {
        let Self { t, .. } = self;
        let set_cols = self.set_cols();
        let applied_or_dup = APPLIED_OR_DUP;
        let no_dup = NO_DUP;
        let mut p = Params::default();
        let i = self.input(&mut p, true);
        let lease = p.lease();
        p.finish(format!(
            "WITH {i}, w AS (UPDATE {t} AS tgt SET {set_cols}\"fence\" = {next} FROM i \
             WHERE {m} AND {admit} AND {no_dup} RETURNING i.ord) {applied_or_dup}",
            next = next_fence("tgt.\"fence\"", &lease),
            m = self.matches("tgt"),
            admit = admits("tgt.\"fence\"", &lease),
        ))
    }

    /// Single-row updates of many leases in one statement: the input carries each row's lease
    /// fence (`lf`) and timeline (`tl`); of rows naming the same key only the first is
    /// written (`f`), so no row is updated twice by one statement.
    fn coalesced_update(&self) -> Statement {
        let Self {
            t, keys, cols, kn, ..
        } = self;
        let mut p = Params::default();
        let mut arrays = p.many(Slot::KeyArrays, keys.len());
        arrays.extend(p.many(Slot::ColumnArrays, cols.len()));
        arrays.push(p.one(Slot::LeaseFences));
        arrays.push(p.one(Slot::Timelines));
        let names: Vec<String> = (0..keys.len())
            .map(|i| format!("k{i}"))
            .chain((0..cols.len()).map(|i| format!("c{i}")))
            .chain(["lf".to_owned(), "tl".to_owned()])
            .collect();
        let unnests: Vec<String> = arrays
            .iter()
            .map(|a| format!("pg_catalog.unnest({a})"))
            .collect();
        let earlier = kn
            .iter()
            .map(|k| format!("{} {EQ} {k}", k.replacen("i.", "j.", 1)))
            .collect::<Vec<_>>()
            .join(" AND ");
        let lease = LeaseParams {
            fence: "i.lf".to_owned(),
            timeline: "i.tl".to_owned(),
        };
        p.finish(format!(
            "WITH i AS (SELECT * FROM ROWS FROM ({unnests}) WITH ORDINALITY AS i({names}, ord)) \
             UPDATE {t} AS tgt SET {set_cols}\"fence\" = {next} FROM i \
             WHERE {m} AND {admit} AND NOT EXISTS (SELECT FROM i AS j WHERE {earlier} \
             AND j.ord {LT} i.ord) RETURNING i.ord",
            unnests = unnests.join(", "),
            names = names.join(", "),
            set_cols = self.set_cols(),
            next = next_fence("tgt.\"fence\"", &lease.fence),
            m = self.matches("tgt"),
            admit = admits("tgt.\"fence\"", &lease),
        ))
    }

    /// The batch upsert.
    fn upsert(&self) -> Statement {
        let Self {
            t,
            rel,
            keys,
            cols,
            kn,
            cn,
            ..
        } = self;
        let no_dup = NO_DUP;
        let mut p = Params::default();
        let i = self.input(&mut p, true);
        let lease = p.lease();
        let all_vals: Vec<String> = kn.iter().chain(cn).cloned().collect();
        let (all_cols, conflict_set, key_cols) = upsert_parts(keys, cols);
        let returned: Vec<String> = keys
            .iter()
            .enumerate()
            .map(|(n, c)| format!("cur.{} AS r{n}", c.quoted()))
            .collect();
        let joined = keys
            .iter()
            .enumerate()
            .map(|(n, _)| format!("w.r{n} {EQ} i.k{n}"))
            .collect::<Vec<_>>()
            .join(" AND ");
        let tomb = format!(
            "(SELECT tb.fence FROM pgfence.tombstone tb WHERE tb.rel {EQ} {rel} \
             AND tb.row_key {EQ} {})",
            key_json(kn)
        );
        p.finish(format!(
            "WITH {i}, w AS (INSERT INTO {t} AS cur ({cols}, \"fence\") \
             SELECT {vals}, {lease} FROM i WHERE {no_dup} \
             AND (coalesce({tomb_admits}, true) OR EXISTS (SELECT 1 FROM {t} x WHERE {mx})) \
             ON CONFLICT ({keys}) DO UPDATE SET {conflict_set}\"fence\" = {next} \
             WHERE {admit} \
             RETURNING {returned}, (cur.xmax {EQ} 0) AS inserted) \
             SELECT i.ord, w.inserted, NULL::pg_catalog.text AS dup FROM w JOIN i ON {joined} \
             UNION ALL SELECT NULL, NULL, dup.key FROM dup",
            cols = all_cols.join(", "),
            vals = all_vals.join(", "),
            tomb_admits = admits(&tomb, &lease),
            mx = self.matches("x"),
            keys = key_cols.join(", "),
            next = next_fence("cur.\"fence\"", &lease),
            admit = admits("cur.\"fence\"", &lease),
            returned = returned.join(", "),
        ))
    }

    /// The batch delete, leaving tombstones.
    fn delete(&self) -> Statement {
        let Self { t, rel, kn, .. } = self;
        let applied_or_dup = APPLIED_OR_DUP;
        let no_dup = NO_DUP;
        let mut p = Params::default();
        let i = self.input(&mut p, false);
        let lease = p.lease();
        p.finish(format!(
            "WITH {i}, w AS (DELETE FROM {t} AS tgt USING i WHERE {m} AND {admit} AND {no_dup} \
             RETURNING i.ord, {kj} AS key, {next} AS f), \
             tomb AS (INSERT INTO pgfence.tombstone AS tb (rel, row_key, fence) \
             SELECT {rel}, w.key, w.f FROM w \
             ON CONFLICT (rel, row_key) DO UPDATE SET fence = GREATEST(tb.fence, EXCLUDED.fence), \
             deleted_at = pg_catalog.now()) {applied_or_dup}",
            m = self.matches("tgt"),
            admit = admits("tgt.\"fence\"", &lease),
            kj = key_json(kn),
            next = next_fence("tgt.\"fence\"", &lease),
        ))
    }

    /// The batch claim: the claimed rows (`tgt.*`) with their position; `pgfence_dups` counts
    /// duplicate keys (then nothing was claimed and the row's other columns are NULL).
    fn claim(&self) -> Statement {
        let Self { t, .. } = self;
        let no_dup = NO_DUP;
        let mut p = Params::default();
        let i = self.input(&mut p, false);
        let lease = p.lease();
        p.finish(format!(
            "WITH {i}, w AS (UPDATE {t} AS tgt SET \"fence\" = {next} FROM i \
             WHERE {m} AND {admit} AND {no_dup} RETURNING i.ord AS pgfence_ord, tgt.*) \
             SELECT d.pgfence_dups, w.* FROM (SELECT pg_catalog.count(*) AS pgfence_dups FROM dup) d \
             LEFT JOIN w ON true ORDER BY w.pgfence_ord",
            next = next_fence("tgt.\"fence\"", &lease),
            m = self.matches("tgt"),
            admit = admits("tgt.\"fence\"", &lease),
        ))
    }

    /// The batch's explaining statement, one row per rejected input row.
    fn explain(&self, operation: &str, with_tombstone: bool) -> Statement {
        let Self {
            t,
            table_literal,
            rel,
            keys,
            audit_lock_timeout_ms,
            kn,
            ..
        } = self;
        let mut p = Params::default();
        let arrays = p.many(Slot::KeyArrays, keys.len());
        let ords = p.one(Slot::Ordinals);
        let lease = p.one(Slot::LeaseFence);
        let mut unnests: Vec<String> = arrays
            .iter()
            .map(|a| format!("pg_catalog.unnest({a})"))
            .collect();
        unnests.push(format!("pg_catalog.unnest({ords})"));
        let mut names: Vec<String> = (0..keys.len()).map(|i| format!("k{i}")).collect();
        names.push("ord".to_owned());
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
                format!(
                    ", (SELECT tb.fence FROM pgfence.tombstone tb WHERE tb.rel {EQ} {rel} \
                     AND tb.row_key {EQ} {}) AS tombstone",
                    key_json(kn)
                ),
            )
        } else {
            ("", String::new())
        };
        p.finish(format!(
            "SELECT c.ord, c.current, c.row_key{outer}, {audit} AS audit, pgfence.timeline() AS timeline FROM (\
             SELECT i.ord, (SELECT tgt.\"fence\" FROM {t} tgt WHERE {m}) AS current, \
             {kj} AS row_key{inner} \
             FROM ROWS FROM ({u}) AS i({n}) OFFSET 0) c ORDER BY c.ord",
            m = self.matches("tgt"),
            kj = key_json(kn),
            u = unnests.join(", "),
            n = names.join(", "),
        ))
    }
}
