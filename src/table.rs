//! Declaring a table: [`FencedTable`] says which table a struct writes, its key and its
//! columns, and how to bind them. Implement it with `#[derive(FencedTable)]` (feature
//! `derive`) or [`fenced_table!`](crate::fenced_table); [`Repository`](crate::Repository)
//! writes through it and [`Repository::verify`](crate::Repository::verify)(crate::Repository::verify) checks it against
//! the catalog. [`TableName`] and [`Ident`] are the quoted SQL names pgfence builds every
//! statement from.

use std::fmt;

use sqlx::Postgres;
use sqlx::TypeInfo;
use sqlx::postgres::{PgArguments, PgTypeInfo};

pub use crate::ident::{Ident, MAX_IDENT_LEN, TableName};

/// A query under construction, as handed to [`FencedTable`]'s bind methods.
pub type PgQuery = sqlx::query::Query<'static, Postgres, PgArguments>;

/// A table whose rows are written only with a fence token.
///
/// Implement it with `#[derive(FencedTable)]` (feature `derive`, on by default: the same
/// struct can derive `sqlx::FromRow` to read rows) or [`fenced_table!`](crate::fenced_table);
/// by hand, the bind methods must bind exactly the columns listed, in order.
///
/// ```
/// #[derive(Debug, Clone, sqlx::FromRow, pgfence::FencedTable)]
/// #[fenced(schema = "billing", table = "ledger_line")]
/// struct Line {
///     #[fenced(key)]
///     batch: i64,
///     #[fenced(key)]
///     line: i32,
///     #[sqlx(rename = "amount_cents")] // the column's name, for reads and writes
///     amount: i64,
///     #[fenced(skip)] // read by FromRow, never written
///     fence: i64,
/// }
///
/// use pgfence::FencedTable;
/// assert_eq!(Line::KEY_COLUMNS, ["batch", "line"]);
/// assert_eq!(Line::COLUMNS, ["amount_cents"]);
/// let key: <Line as FencedTable>::Key = (7, 1); // (i64, i32), from the fields
/// # let _ = key;
/// ```
pub trait FencedTable: Send + Sync + 'static {
    /// The key, as passed to [`Repository::delete`](crate::Repository::delete): a single value or a tuple.
    type Key: Send + Sync;
    /// Schema of the table (default `public`).
    const SCHEMA: &'static str = "public";
    /// Table name, as stored in the catalog.
    const TABLE: &'static str;
    /// Columns of the primary key (or another unique key, which `upsert` targets).
    const KEY_COLUMNS: &'static [&'static str];
    /// The other columns a write sets (not `fence`, which pgfence manages).
    const COLUMNS: &'static [&'static str];
    /// Binds this row's key columns, in [`Self::KEY_COLUMNS`] order.
    fn bind_key(&self, query: PgQuery) -> PgQuery;
    /// Binds this row's other columns, in [`Self::COLUMNS`] order.
    fn bind_columns(&self, query: PgQuery) -> PgQuery;
    /// Binds a bare key, in [`Self::KEY_COLUMNS`] order.
    fn bind_key_value(key: &Self::Key, query: PgQuery) -> PgQuery;

    /// Binds the key columns of `rows` as arrays, one per key column in
    /// [`Self::KEY_COLUMNS`] order, for batch writes ([`Repository::update_many`](crate::Repository::update_many)...).
    /// [`fenced_table!`](crate::fenced_table) implements it; the default returns `None`, and
    /// batch methods then fail with [`InvalidInput::Batch`](crate::error::InvalidInput::Batch).
    fn bind_key_arrays(rows: &[&Self], query: PgQuery) -> Option<PgQuery> {
        let _ = (rows, query);
        None
    }
    /// Binds the other columns of `rows` as arrays, one per column in [`Self::COLUMNS`]
    /// order. See [`FencedTable::bind_key_arrays`].
    fn bind_column_arrays(rows: &[&Self], query: PgQuery) -> Option<PgQuery> {
        let _ = (rows, query);
        None
    }
    /// Binds bare keys as arrays, one per key column. See [`FencedTable::bind_key_arrays`].
    fn bind_key_value_arrays(keys: &[&Self::Key], query: PgQuery) -> Option<PgQuery> {
        let _ = (keys, query);
        None
    }

    /// Binds this row's value of one data column, `column` (one of [`Self::COLUMNS`]), for
    /// [`Repository::update_columns`](crate::Repository::update_columns). The derive and [`fenced_table!`](crate::fenced_table)
    /// implement it; the default returns `None`, and `update_columns` then fails with
    /// [`InvalidInput::Table`](crate::error::InvalidInput::Table) before sending anything.
    fn bind_column(&self, column: &str, query: PgQuery) -> Option<PgQuery> {
        let _ = (column, query);
        None
    }

    /// The Rust types of the key columns, one per [`Self::KEY_COLUMNS`] entry, which
    /// [`Repository::verify`](crate::Repository::verify) checks against the catalog. Empty (the default) leaves them
    /// unchecked.
    fn key_types() -> Vec<ColumnType> {
        Vec::new()
    }

    /// A hash of this row's key ([`hash_key`]), equal to [`FencedTable::key_value_hash`] of
    /// the same key: how a lease remembers the fence it last saw on the row, so its next write
    /// there is one statement. The derive and [`fenced_table!`](crate::fenced_table)
    /// implement it; the default returns `None`, and a lease's repeated write to a row then
    /// costs one more round trip (it learns the row's fence from the refusal).
    fn key_hash(&self) -> Option<u64> {
        None
    }

    /// A hash of a bare key ([`hash_key`]). See [`FencedTable::key_hash`].
    fn key_value_hash(key: &Self::Key) -> Option<u64> {
        let _ = key;
        None
    }

    /// The Rust types of the data columns, one per [`Self::COLUMNS`] entry, for
    /// [`Repository::verify`](crate::Repository::verify). The derive knows them; [`fenced_table!`](crate::fenced_table)
    /// (which names only the columns) and the default return an empty list: unchecked.
    fn column_types() -> Vec<ColumnType> {
        Vec::new()
    }
}

/// Binds the columns of tuple keys as arrays, one per element (for
/// [`FencedTable::bind_key_value_arrays`] of composite keys; used by
/// [`fenced_table!`](crate::fenced_table)).
pub trait KeyArrays {
    /// Binds `keys`' elements as one array per tuple position.
    fn bind_arrays(keys: &[&Self], query: PgQuery) -> PgQuery;
}

macro_rules! key_arrays_for_tuples {
    ($(($($t:ident . $i:tt),+))+) => {$(
        impl<$($t),+> KeyArrays for ($($t,)+)
        where
            $($t: Clone, Vec<$t>: for<'q> sqlx::Encode<'q, Postgres> + sqlx::Type<Postgres> + Send + 'static,)+
        {
            fn bind_arrays(keys: &[&Self], query: PgQuery) -> PgQuery {
                query $(.bind(keys.iter().map(|k| k.$i.clone()).collect::<Vec<$t>>()))+
            }
        }
    )+};
}

key_arrays_for_tuples! {
    (A.0)
    (A.0, B.1)
    (A.0, B.1, C.2)
    (A.0, B.1, C.2, D.3)
}

/// Declares a struct as a fenced table: its field names are the column names.
///
/// ```
/// #[derive(Debug, Clone)]
/// struct Snapshot { sku: String, payload: String, qty: i32 }
///
/// pgfence::fenced_table!(Snapshot {
///     table: "inventory_snapshot",
///     key: sku: String,
///     columns: [payload, qty],
/// });
///
/// // Composite key, explicit schema:
/// struct Line { batch: i64, line: i32, amount: i64 }
/// pgfence::fenced_table!(Line {
///     schema: "billing",
///     table: "ledger_line",
///     key: (batch: i64, line: i32),
///     columns: [amount],
/// });
/// ```
#[macro_export]
macro_rules! fenced_table {
    ($ty:ty { $(schema: $schema:literal,)? table: $table:literal,
        key: ($($key:ident : $kty:ty),+ $(,)?), columns: [$($col:ident),* $(,)?] $(,)? }) => {
        impl $crate::FencedTable for $ty {
            type Key = ($($kty,)+);
            $(const SCHEMA: &'static str = $schema;)?
            const TABLE: &'static str = $table;
            const KEY_COLUMNS: &'static [&'static str] = &[$(stringify!($key)),+];
            const COLUMNS: &'static [&'static str] = &[$(stringify!($col)),*];
            fn bind_key(&self, q: $crate::table::PgQuery) -> $crate::table::PgQuery { q $(.bind(&self.$key))+ }
            fn bind_columns(&self, q: $crate::table::PgQuery) -> $crate::table::PgQuery { q $(.bind(&self.$col))* }
            fn bind_key_value(key: &Self::Key, q: $crate::table::PgQuery) -> $crate::table::PgQuery {
                #[allow(non_snake_case)]
                let ($($key,)+) = key;
                q $(.bind($key))+
            }
            fn bind_key_arrays(rows: &[&Self], q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                Some(q $(.bind(rows.iter().map(|r| r.$key.clone()).collect::<Vec<_>>()))+)
            }
            fn bind_column_arrays(rows: &[&Self], q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                Some(q $(.bind(rows.iter().map(|r| r.$col.clone()).collect::<Vec<_>>()))*)
            }
            fn bind_key_value_arrays(keys: &[&Self::Key], q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                Some(<Self::Key as $crate::table::KeyArrays>::bind_arrays(keys, q))
            }
            fn bind_column(&self, column: &str, q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                $(if column == stringify!($col) { return Some(q.bind(&self.$col)); })*
                let _ = (column, q);
                None
            }
            fn key_types() -> ::std::vec::Vec<$crate::table::ColumnType> {
                ::std::vec![$($crate::table::ColumnType::of::<$kty>()),+]
            }
            fn key_hash(&self) -> Option<u64> {
                Some($crate::table::hash_key(&($(&self.$key,)+)))
            }
            fn key_value_hash(key: &Self::Key) -> Option<u64> {
                #[allow(non_snake_case)]
                let ($($key,)+) = key;
                Some($crate::table::hash_key(&($($key,)+)))
            }
        }
    };
    ($ty:ty { $(schema: $schema:literal,)? table: $table:literal,
        key: $key:ident : $kty:ty, columns: [$($col:ident),* $(,)?] $(,)? }) => {
        impl $crate::FencedTable for $ty {
            type Key = $kty;
            $(const SCHEMA: &'static str = $schema;)?
            const TABLE: &'static str = $table;
            const KEY_COLUMNS: &'static [&'static str] = &[stringify!($key)];
            const COLUMNS: &'static [&'static str] = &[$(stringify!($col)),*];
            fn bind_key(&self, q: $crate::table::PgQuery) -> $crate::table::PgQuery { q.bind(&self.$key) }
            fn bind_columns(&self, q: $crate::table::PgQuery) -> $crate::table::PgQuery { q $(.bind(&self.$col))* }
            fn bind_key_value(key: &Self::Key, q: $crate::table::PgQuery) -> $crate::table::PgQuery { q.bind(key) }
            fn bind_key_arrays(rows: &[&Self], q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                Some(q.bind(rows.iter().map(|r| r.$key.clone()).collect::<Vec<_>>()))
            }
            fn bind_column_arrays(rows: &[&Self], q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                Some(q $(.bind(rows.iter().map(|r| r.$col.clone()).collect::<Vec<_>>()))*)
            }
            fn bind_key_value_arrays(keys: &[&Self::Key], q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                Some(q.bind(keys.iter().map(|k| (*k).clone()).collect::<Vec<$kty>>()))
            }
            fn bind_column(&self, column: &str, q: $crate::table::PgQuery) -> Option<$crate::table::PgQuery> {
                $(if column == stringify!($col) { return Some(q.bind(&self.$col)); })*
                let _ = (column, q);
                None
            }
            fn key_types() -> ::std::vec::Vec<$crate::table::ColumnType> {
                ::std::vec![$crate::table::ColumnType::of::<$kty>()]
            }
            fn key_hash(&self) -> Option<u64> {
                Some($crate::table::hash_key(&self.$key))
            }
            fn key_value_hash(key: &Self::Key) -> Option<u64> {
                Some($crate::table::hash_key(key))
            }
        }
    };
}

/// The hash [`FencedTable::key_hash`] uses: std's `DefaultHasher` with its fixed keys, so a
/// row's key and the bare key hash alike within one process.
#[doc(hidden)]
#[must_use]
pub fn hash_key<K: std::hash::Hash + ?Sized>(key: &K) -> u64 {
    use std::hash::Hasher;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    key.hash(&mut h);
    h.finish()
}

/// The Rust side of a column: the type a [`FencedTable`] binds and reads, and which
/// Postgres types sqlx accepts for it ([`sqlx::Type::compatible`]). Returned by
/// [`FencedTable::key_types`] and [`FencedTable::column_types`].
#[derive(Clone)]
pub struct ColumnType {
    rust: &'static str,
    type_info: PgTypeInfo,
    compatible: fn(&PgTypeInfo) -> bool,
}

impl ColumnType {
    /// The column type of the Rust type `R`.
    #[must_use]
    pub fn of<R: sqlx::Type<Postgres> + ?Sized>() -> Self {
        Self {
            rust: std::any::type_name::<R>(),
            type_info: R::type_info(),
            compatible: R::compatible,
        }
    }

    /// The Rust type's name, without module paths (`Option<String>`).
    #[must_use]
    pub fn rust_name(&self) -> String {
        short_type_name(self.rust)
    }

    /// The Postgres type sqlx binds the Rust type as.
    #[must_use]
    pub fn type_info(&self) -> &PgTypeInfo {
        &self.type_info
    }

    /// Whether sqlx reads and writes the Rust type as a column of type `ty`. Types sqlx
    /// names rather than numbers (enums, domains, extension types) are taken as compatible.
    #[must_use]
    pub fn is_compatible(&self, ty: &PgTypeInfo) -> bool {
        (self.compatible)(ty)
    }
}

impl fmt::Debug for ColumnType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ColumnType")
            .field("rust", &self.rust)
            .field("postgres", &self.type_info.name())
            .finish()
    }
}

/// `alloc::string::String` → `String`, `core::option::Option<alloc::string::String>` →
/// `Option<String>`: every path keeps its last segment.
fn short_type_name(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut segment = String::new();
    for ch in full.chars() {
        if ch.is_alphanumeric() || ch == '_' || ch == ':' {
            segment.push(ch);
        } else {
            out.push_str(segment.rsplit("::").next().unwrap_or(&segment));
            segment.clear();
            out.push(ch);
        }
    }
    out.push_str(segment.rsplit("::").next().unwrap_or(&segment));
    out
}
