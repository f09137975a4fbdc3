//! [`Condition`]: the caller's own predicate on a fenced write (an optimistic-locking
//! `version = $n`), checked in the write's own statement beside the fence.
//!
//! Column names are [`Ident`]s, quoted where the statement is built (`sql/single.rs`);
//! values are bind parameters, never SQL text.

use std::fmt;
use std::sync::Arc;

use sqlx::Postgres;

use crate::Result;
use crate::error::InvalidInput;
use crate::ident::Ident;
use crate::table::PgQuery;

/// A condition the row must meet for a conditional write
/// ([`Repository::update_if`](crate::Repository::update_if),
/// [`update_columns_if`](crate::Repository::update_columns_if),
/// [`delete_if`](crate::Repository::delete_if)): one or more column tests, all of which must
/// hold. It rides the write's own statement (`... WHERE <key> AND <fence admits the lease> AND
/// <condition>`), so it is checked atomically with the fence; a write it refuses reports
/// [`Error::ConditionFailed`](crate::Error::ConditionFailed), told apart from a fence's refusal
/// ([`Error::StaleToken`](crate::Error::StaleToken) and the other fenced errors, which win when
/// both refuse) and from [`Error::NotFound`](crate::Error::NotFound).
///
/// Columns are any of the table's columns but `fence` (declared or not); values are bound as
/// parameters of their sqlx type, compared with the catalog's operators. A test against a NULL
/// column does not hold (SQL's rule), except [`Condition::is_null`].
///
/// # Example
/// ```
/// use pgfence::repository::Condition;
///
/// // The row must still carry the version this job read, and not be archived.
/// let cond = Condition::eq("version", 7_i64)?.and(Condition::is_null("archived_at")?);
/// assert_eq!(cond.to_string(), "\"version\" = $value AND \"archived_at\" IS NULL");
/// // `fence` is pgfence's: a condition cannot name it.
/// assert!(Condition::eq("fence", 1_i64).is_err());
/// # Ok::<(), pgfence::Error>(())
/// ```
#[derive(Clone)]
pub struct Condition {
    terms: Vec<Term>,
}

#[derive(Clone)]
pub(crate) struct Term {
    pub(crate) column: Ident,
    pub(crate) test: Test,
}

/// What a term tests.
#[derive(Clone)]
pub(crate) enum Test {
    /// `column <op> $n`.
    Compare(Cmp, Value),
    /// `column IS NULL`.
    IsNull,
    /// `column IS NOT NULL`.
    IsNotNull,
}

/// A comparison, by the catalog operator it is written with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cmp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Cmp {
    /// The operator's name (as in `OPERATOR(pg_catalog.=)`).
    pub(crate) fn symbol(self) -> &'static str {
        match self {
            Cmp::Eq => "=",
            Cmp::Ne => "<>",
            Cmp::Lt => "<",
            Cmp::Le => "<=",
            Cmp::Gt => ">",
            Cmp::Ge => ">=",
        }
    }
}

/// A value to bind: kept as the function that binds it, so that a write sent again (after a
/// rebind to a new timeline) binds it again.
#[derive(Clone)]
pub(crate) struct Value(Arc<dyn Fn(PgQuery) -> PgQuery + Send + Sync>);

impl Value {
    fn of<V>(value: V) -> Self
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self(Arc::new(move |q: PgQuery| q.bind(value.clone())))
    }

    pub(crate) fn bind(&self, q: PgQuery) -> PgQuery {
        (self.0)(q)
    }
}

impl Condition {
    fn term(column: &str, test: Test) -> Result<Self> {
        let column = Ident::new(column)?;
        if column.as_str() == "fence" {
            return Err(crate::Error::Invalid(InvalidInput::Identifier {
                name: column.as_str().to_owned(),
                reason: "is managed by pgfence (the fence admits the lease): a condition tests the table's own columns",
            }));
        }
        Ok(Self {
            terms: vec![Term { column, test }],
        })
    }

    fn compare<V>(column: &str, cmp: Cmp, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::term(column, Test::Compare(cmp, Value::of(value)))
    }

    /// `column = value` (the optimistic lock's `version = $n`).
    ///
    /// # Errors
    /// [`InvalidInput::Identifier`] for a name that is not an identifier, or `fence`.
    pub fn eq<V>(column: &str, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::compare(column, Cmp::Eq, value)
    }

    /// `column <> value`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn ne<V>(column: &str, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::compare(column, Cmp::Ne, value)
    }

    /// `column < value`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn lt<V>(column: &str, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::compare(column, Cmp::Lt, value)
    }

    /// `column <= value`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn le<V>(column: &str, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::compare(column, Cmp::Le, value)
    }

    /// `column > value`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn gt<V>(column: &str, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::compare(column, Cmp::Gt, value)
    }

    /// `column >= value`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn ge<V>(column: &str, value: V) -> Result<Self>
    where
        V: for<'q> sqlx::Encode<'q, Postgres>
            + sqlx::Type<Postgres>
            + Clone
            + Send
            + Sync
            + 'static,
    {
        Self::compare(column, Cmp::Ge, value)
    }

    /// `column IS NULL`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn is_null(column: &str) -> Result<Self> {
        Self::term(column, Test::IsNull)
    }

    /// `column IS NOT NULL`.
    ///
    /// # Errors
    /// As [`Condition::eq`].
    pub fn is_not_null(column: &str) -> Result<Self> {
        Self::term(column, Test::IsNotNull)
    }

    /// Both conditions: every test of `self` and of `other` must hold.
    #[must_use]
    pub fn and(mut self, other: Condition) -> Self {
        self.terms.extend(other.terms);
        self
    }

    /// The tests, in order (their values are bound in this order).
    pub(crate) fn terms(&self) -> &[Term] {
        &self.terms
    }
}

/// The condition as SQL-like text without its values (`"version" = $value`): what
/// [`Error::ConditionFailed`](crate::Error::ConditionFailed) quotes. Values are never shown.
impl fmt::Display for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, term) in self.terms.iter().enumerate() {
            if i > 0 {
                f.write_str(" AND ")?;
            }
            let column = term.column.quoted();
            match &term.test {
                Test::Compare(cmp, _) => write!(f, "{column} {} $value", cmp.symbol())?,
                Test::IsNull => write!(f, "{column} IS NULL")?,
                Test::IsNotNull => write!(f, "{column} IS NOT NULL")?,
            }
        }
        Ok(())
    }
}

impl fmt::Debug for Condition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("Condition").field(&self.to_string()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_identifiers_and_fence_is_refused() {
        assert!(matches!(
            Condition::eq("fence", 1_i64),
            Err(crate::Error::Invalid(InvalidInput::Identifier { .. }))
        ));
        assert!(matches!(
            Condition::is_null(""),
            Err(crate::Error::Invalid(InvalidInput::Identifier { .. }))
        ));
        let hostile = Condition::eq("v\"; DROP TABLE t; --", 1_i64).unwrap();
        assert_eq!(hostile.to_string(), "\"v\"\"; DROP TABLE t; --\" = $value");
    }
}
