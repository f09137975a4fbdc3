//! SQL identifiers supplied by users, validated and quoted. This is the only place where SQL
//! text is made from user-supplied names: every other module goes through [`Ident`] and
//! [`TableName`].

use crate::error::InvalidInput;
use std::fmt;

use crate::{Error, Result};

/// Postgres truncates identifiers to 63 bytes; a longer name would silently address a
/// different object, so it is refused instead.
pub const MAX_IDENT_LEN: usize = 63;

/// A validated SQL identifier (schema, table or column name), exactly as stored in the catalog
/// (case-sensitive: `Payments` and `payments` are different tables).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Ident(String);

impl Ident {
    /// Validates `name`: 1 to 63 bytes, no NUL. Any other character is allowed and quoted.
    ///
    /// # Errors
    /// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier).
    pub fn new(name: impl Into<String>) -> Result<Self> {
        let name = name.into();
        let reason = if name.is_empty() {
            Some("empty")
        } else if name.len() > MAX_IDENT_LEN {
            Some("longer than 63 bytes (Postgres would truncate it)")
        } else if name.contains('\0') {
            Some("contains a NUL byte")
        } else {
            None
        };
        match reason {
            Some(reason) => Err(Error::Invalid(InvalidInput::Identifier {
                name: display_name(&name),
                reason,
            })),
            None => Ok(Self(name)),
        }
    }

    /// The name as stored in the catalog.
    #[must_use]
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The identifier quoted for SQL text: `"name"` with inner `"` doubled.
    #[must_use]
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0.replace('"', "\"\""))
    }
}

impl fmt::Display for Ident {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.quoted())
    }
}

fn display_name(name: &str) -> String {
    let mut s: String = name.chars().take(80).collect();
    if s.len() < name.len() {
        s.push('…');
    }
    s
}

/// A table name, optionally schema-qualified. Without a schema, `public` is assumed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TableName {
    schema: Ident,
    name: Ident,
}

impl TableName {
    /// A table in `schema`.
    ///
    /// # Errors
    /// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier) for either part.
    pub fn new(schema: &str, name: &str) -> Result<Self> {
        Ok(Self {
            schema: Ident::new(schema)?,
            name: Ident::new(name)?,
        })
    }

    /// Parses the command-line form: `table` or `schema.table`, where either part may be
    /// double-quoted (with `""` for a literal quote) to contain dots or capitals as stored.
    /// Unquoted parts are case-folded the way SQL folds them (ASCII `A`-`Z` to lower case,
    /// other characters kept), so `Payments` names the table `payments`, as it would in
    /// `SELECT * FROM Payments`, and `"Payments"` names the table whose catalog name is
    /// `Payments`. [`TableName::new`] takes names as stored, without folding.
    ///
    /// # Errors
    /// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier) for malformed input.
    pub fn parse(s: &str) -> Result<Self> {
        let parts = split_qualified(s)?;
        match parts.as_slice() {
            [name] => Self::new("public", name),
            [schema, name] => Self::new(schema, name),
            _ => Err(Error::Invalid(InvalidInput::Identifier {
                name: display_name(s),
                reason: "expected table or schema.table",
            })),
        }
    }

    /// The schema.
    #[must_use]
    pub fn schema(&self) -> &Ident {
        &self.schema
    }

    /// The table's own name.
    #[must_use]
    pub fn name(&self) -> &Ident {
        &self.name
    }

    /// `"schema"."table"`, for SQL text.
    #[must_use]
    pub fn quoted(&self) -> String {
        format!("{}.{}", self.schema.quoted(), self.name.quoted())
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.quoted())
    }
}

fn split_qualified(s: &str) -> Result<Vec<String>> {
    let bad = |reason| {
        Error::Invalid(InvalidInput::Identifier {
            name: display_name(s),
            reason,
        })
    };
    let mut parts = Vec::new();
    let mut chars = s.chars().peekable();
    loop {
        let mut part = String::new();
        // Quoted parts keep their case; unquoted ones fold ASCII letters, as SQL does.
        if chars.peek() == Some(&'"') {
            chars.next();
            loop {
                match chars.next() {
                    Some('"') if chars.peek() == Some(&'"') => {
                        chars.next();
                        part.push('"');
                    }
                    Some('"') => break,
                    Some(c) => part.push(c),
                    None => return Err(bad("unterminated quoted identifier")),
                }
            }
        } else {
            while let Some(&c) = chars.peek() {
                if c == '.' {
                    break;
                }
                if c == '"' {
                    return Err(bad("stray quote in unquoted identifier"));
                }
                part.push(c.to_ascii_lowercase());
                chars.next();
            }
        }
        parts.push(part);
        match chars.next() {
            None => return Ok(parts),
            Some('.') => {}
            Some(_) => return Err(bad("unexpected text after quoted identifier")),
        }
    }
}

/// Quotes `value` as an SQL string literal: `'...'` with inner `'` doubled, or, when `value`
/// holds a backslash, `E'...'` with backslashes doubled too, which reads the same whatever the
/// server's `standard_conforming_strings`. Used where bind parameters do not exist: the
/// migration files pgfence writes and the PostgreSQL issuer's simple-protocol statements.
///
/// # Errors
/// [`InvalidInput::Identifier`](crate::error::InvalidInput::Identifier) when `value` contains a NUL byte.
pub fn quote_literal(value: &str) -> Result<String> {
    if value.contains('\0') {
        return Err(Error::Invalid(InvalidInput::Identifier {
            name: display_name(value),
            reason: "contains a NUL byte",
        }));
    }
    if value.contains('\\') {
        return Ok(format!(
            "E'{}'",
            value.replace('\\', "\\\\").replace('\'', "''")
        ));
    }
    Ok(format!("'{}'", value.replace('\'', "''")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting() {
        assert_eq!(Ident::new("a\"b").unwrap().quoted(), "\"a\"\"b\"");
        assert_eq!(TableName::parse("t").unwrap().quoted(), "\"public\".\"t\"");
        assert_eq!(TableName::parse("s.T").unwrap().quoted(), "\"s\".\"t\"");
        assert_eq!(
            TableName::parse("\"a.b\".\"c\"\"d\"").unwrap().quoted(),
            "\"a.b\".\"c\"\"d\""
        );
        assert_eq!(quote_literal("it's").unwrap(), "'it''s'");
    }

    #[test]
    fn folds_unquoted_names_like_sql() {
        let t = TableName::parse("MixedCase").unwrap();
        assert_eq!(
            (t.schema().as_str(), t.name().as_str()),
            ("public", "mixedcase")
        );
        let t = TableName::parse("\"MixedCase\"").unwrap();
        assert_eq!(t.name().as_str(), "MixedCase");
        let t = TableName::parse("Billing.\"Invoices\"").unwrap();
        assert_eq!(
            (t.schema().as_str(), t.name().as_str()),
            ("billing", "Invoices")
        );
        let t = TableName::parse("\"Billing\".INVOICES").unwrap();
        assert_eq!(
            (t.schema().as_str(), t.name().as_str()),
            ("Billing", "invoices")
        );
        // Only ASCII letters fold (as in a UTF-8 database); other characters are kept.
        assert_eq!(TableName::parse("ÉtÉ_T").unwrap().name().as_str(), "ÉtÉ_t");
        // Quoted parts may still contain dots and quotes, exactly as written.
        let t = TableName::parse("\"A.B\".\"C\"\"D\"").unwrap();
        assert_eq!((t.schema().as_str(), t.name().as_str()), ("A.B", "C\"D"));
        // `new` takes names as stored.
        assert_eq!(TableName::new("S", "T").unwrap().quoted(), "\"S\".\"T\"");
    }

    #[test]
    fn rejects() {
        for bad in ["", "a.b.c", "\"x", "a\"b", "\"a\"b", &"x".repeat(64), "x\0"] {
            assert!(TableName::parse(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Ident::new("é".repeat(31)).is_ok()); // 62 bytes
        assert!(Ident::new("é".repeat(32)).is_err()); // 64 bytes
    }
}
