//! `#[derive(FencedTable)]`: declares a struct as a pgfence fenced table, from the same
//! fields (and the same `#[sqlx(...)]` attributes) that `#[derive(sqlx::FromRow)]` reads, so
//! one struct reads rows (`claim`, `fetch`) and writes them (`update`, `upsert`, batches).
//!
//! Use it through pgfence, which re-exports it as `pgfence::FencedTable` (feature `derive`,
//! on by default):
//!
//! ```ignore
//! #[derive(Debug, Clone, sqlx::FromRow, pgfence::FencedTable)]
//! #[fenced(schema = "billing", table = "invoices")]
//! struct Invoice {
//!     #[fenced(key)]
//!     id: i64,
//!     #[sqlx(rename = "state")]      // the column is `state`, for reads and writes
//!     status: String,
//!     amount: i64,
//!     #[fenced(skip)]                 // read by FromRow, never written
//!     fence: i64,
//! }
//! ```
//!
//! The attributes are described on the derive itself, [`FencedTable`](derive@FencedTable), so
//! that pgfence's documentation of its re-export shows them too.

use proc_macro::TokenStream;
use proc_macro2::{Span, TokenStream as TokenStream2};
use quote::{format_ident, quote};
use syn::ext::IdentExt;
use syn::punctuated::Punctuated;
use syn::{
    Data, DataStruct, DeriveInput, Error, Expr, ExprLit, Fields, Ident, Lit, LitStr, Meta, Path,
    Token, Type, parse_macro_input,
};

/// Postgres truncates identifiers longer than this many bytes.
const MAX_IDENT_LEN: usize = 63;

/// Implements `pgfence::FencedTable` for a struct with named fields (an example is in
/// [`pgfence_derive`](crate)'s documentation).
///
/// Attributes:
///
/// | where | attribute | meaning |
/// |---|---|---|
/// | struct | `#[fenced(table = "t")]` | the table (required), as stored in the catalog |
/// | struct | `#[fenced(schema = "s")]` | its schema (default `public`) |
/// | struct | `#[fenced(crate = "path")]` | where pgfence is (default `::pgfence`) |
/// | struct | `#[sqlx(rename_all = "...")]` | honoured as `FromRow` does (for fields without a rename) |
/// | field | `#[fenced(key)]` | a key column; several make a composite key, `Key` = tuple in field order |
/// | field | `#[fenced(skip)]` | not a written column (`FromRow` users add `#[sqlx(skip)]` or `#[sqlx(default)]` if the column does not exist) |
/// | field | `#[fenced(rename = "c")]` or `#[sqlx(rename = "c")]` | the column's name (both may be given if they agree) |
/// | field | `#[sqlx(skip)]` | not a column at all: also skipped for writes |
///
/// `#[sqlx(flatten)]`, `#[sqlx(json)]` and `#[sqlx(try_from = "...")]` fields must be
/// `#[fenced(skip)]` (pgfence binds a field's own type). A field whose column is `fence` must be
/// skipped too: pgfence writes it. Every written field's type must be a sqlx Postgres type
/// (`Encode + Type`), and for batch writes `Clone` with `Vec<T>` an array type, as for
/// `fenced_table!`.
#[proc_macro_derive(FencedTable, attributes(fenced, sqlx))]
pub fn derive_fenced_table(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(Error::into_compile_error)
        .into()
}

/// The struct-level settings.
#[derive(Default)]
struct Container {
    table: Option<LitStr>,
    schema: Option<LitStr>,
    krate: Option<Path>,
    rename_all: Option<RenameAll>,
}

/// sqlx's `rename_all` patterns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RenameAll {
    Lower,
    Snake,
    Upper,
    ScreamingSnake,
    Kebab,
    Camel,
    Pascal,
}

/// One field, as the derive sees it.
struct Column<'a> {
    ident: &'a Ident,
    ty: &'a Type,
    name: String,
    key: bool,
}

/// Every error found, reported together.
#[derive(Default)]
struct Errors(Option<Error>);

impl Errors {
    fn push(&mut self, e: Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

fn expand(input: &DeriveInput) -> syn::Result<TokenStream2> {
    let Data::Struct(DataStruct {
        fields: Fields::Named(named),
        ..
    }) = &input.data
    else {
        return Err(Error::new_spanned(
            &input.ident,
            "#[derive(FencedTable)] needs a struct with named fields",
        ));
    };
    let mut errors = Errors::default();
    let container = parse_container(input, &mut errors);
    let table = container.table.clone().unwrap_or_else(|| {
        errors.push(Error::new_spanned(
            &input.ident,
            "missing #[fenced(table = \"...\")]: the table this struct's rows live in",
        ));
        LitStr::new("", Span::call_site())
    });
    for lit in container.schema.iter().chain(container.table.iter()) {
        check_name(&lit.value(), lit.span(), &mut errors);
    }

    let mut columns: Vec<Column<'_>> = Vec::new();
    for field in &named.named {
        let Some(ident) = field.ident.as_ref() else {
            continue;
        };
        if let Some(column) = parse_field(field, ident, &container, &mut errors) {
            columns.push(column);
        }
    }
    for (i, c) in columns.iter().enumerate() {
        if columns[..i].iter().any(|o| o.name == c.name) {
            errors.push(Error::new_spanned(
                c.ident,
                format!("column \"{}\" is declared twice", c.name),
            ));
        }
    }
    let keys: Vec<&Column<'_>> = columns.iter().filter(|c| c.key).collect();
    let cols: Vec<&Column<'_>> = columns.iter().filter(|c| !c.key).collect();
    if keys.is_empty() {
        errors.push(Error::new_spanned(
            &input.ident,
            "no key: mark the key field(s) #[fenced(key)]",
        ));
    }
    errors.finish()?;

    let krate = container
        .krate
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::pgfence));
    let name = &input.ident;
    let (impl_generics, ty_generics, where_clause) = input.generics.split_for_impl();

    let key_names: Vec<&str> = keys.iter().map(|c| c.name.as_str()).collect();
    let col_names: Vec<&str> = cols.iter().map(|c| c.name.as_str()).collect();
    let key_fields: Vec<&Ident> = keys.iter().map(|c| c.ident).collect();
    let key_tys: Vec<&Type> = keys.iter().map(|c| c.ty).collect();
    let col_fields: Vec<&Ident> = cols.iter().map(|c| c.ident).collect();
    let col_tys: Vec<&Type> = cols.iter().map(|c| c.ty).collect();
    let schema = container
        .schema
        .as_ref()
        .map(|s| quote!(const SCHEMA: &'static str = #s;));

    let (key_type, bind_key_value, bind_key_value_arrays, key_value_hash) =
        if let [only] = key_tys.as_slice() {
            (
                quote!(#only),
                quote!(q.bind(key)),
                quote!(q.bind(
                    keys.iter()
                        .map(|k| ::core::clone::Clone::clone(*k))
                        .collect::<::std::vec::Vec<#only>>()
                )),
                quote!(#krate::table::hash_key(key)),
            )
        } else {
            let vars: Vec<Ident> = (0..keys.len()).map(|i| format_ident!("k{i}")).collect();
            let idx = (0..keys.len()).map(syn::Index::from);
            (
                quote!((#(#key_tys,)*)),
                quote! {
                    let (#(#vars,)*) = key;
                    q #(.bind(#vars))*
                },
                quote!(q #(.bind(
                keys.iter()
                    .map(|k| ::core::clone::Clone::clone(&k.#idx))
                    .collect::<::std::vec::Vec<#key_tys>>()
            ))*),
                quote! {
                    let (#(#vars,)*) = key;
                    #krate::table::hash_key(&(#(#vars,)*))
                },
            )
        };
    let key_hash = if let [only] = key_fields.as_slice() {
        quote!(#krate::table::hash_key(&self.#only))
    } else {
        quote!(#krate::table::hash_key(&(#(&self.#key_fields,)*)))
    };
    let bind_column = if cols.is_empty() {
        quote! {
            let _ = (column, q);
            ::core::option::Option::None
        }
    } else {
        quote! {
            match column {
                #(#col_names => ::core::option::Option::Some(q.bind(&self.#col_fields)),)*
                _ => ::core::option::Option::None,
            }
        }
    };
    let unused_rows = cols.is_empty().then(|| quote!(let _ = rows;));

    Ok(quote! {
        #[automatically_derived]
        #[allow(clippy::clone_on_copy, clippy::needless_borrow, clippy::redundant_clone)]
        impl #impl_generics #krate::FencedTable for #name #ty_generics #where_clause {
            type Key = #key_type;
            #schema
            const TABLE: &'static str = #table;
            const KEY_COLUMNS: &'static [&'static str] = &[#(#key_names),*];
            const COLUMNS: &'static [&'static str] = &[#(#col_names),*];

            fn bind_key(&self, q: #krate::table::PgQuery) -> #krate::table::PgQuery {
                q #(.bind(&self.#key_fields))*
            }
            fn bind_columns(&self, q: #krate::table::PgQuery) -> #krate::table::PgQuery {
                q #(.bind(&self.#col_fields))*
            }
            fn bind_key_value(key: &Self::Key, q: #krate::table::PgQuery) -> #krate::table::PgQuery {
                #bind_key_value
            }
            fn bind_key_arrays(
                rows: &[&Self],
                q: #krate::table::PgQuery,
            ) -> ::core::option::Option<#krate::table::PgQuery> {
                ::core::option::Option::Some(q #(.bind(
                    rows.iter()
                        .map(|r| ::core::clone::Clone::clone(&r.#key_fields))
                        .collect::<::std::vec::Vec<#key_tys>>()
                ))*)
            }
            fn bind_column_arrays(
                rows: &[&Self],
                q: #krate::table::PgQuery,
            ) -> ::core::option::Option<#krate::table::PgQuery> {
                #unused_rows
                ::core::option::Option::Some(q #(.bind(
                    rows.iter()
                        .map(|r| ::core::clone::Clone::clone(&r.#col_fields))
                        .collect::<::std::vec::Vec<#col_tys>>()
                ))*)
            }
            fn bind_key_value_arrays(
                keys: &[&Self::Key],
                q: #krate::table::PgQuery,
            ) -> ::core::option::Option<#krate::table::PgQuery> {
                ::core::option::Option::Some(#bind_key_value_arrays)
            }
            fn bind_column(
                &self,
                column: &str,
                q: #krate::table::PgQuery,
            ) -> ::core::option::Option<#krate::table::PgQuery> {
                #bind_column
            }
            fn key_types() -> ::std::vec::Vec<#krate::table::ColumnType> {
                ::std::vec![#(#krate::table::ColumnType::of::<#key_tys>()),*]
            }
            fn key_hash(&self) -> ::core::option::Option<u64> {
                ::core::option::Option::Some(#key_hash)
            }
            fn key_value_hash(key: &Self::Key) -> ::core::option::Option<u64> {
                ::core::option::Option::Some({ #key_value_hash })
            }
            fn column_types() -> ::std::vec::Vec<#krate::table::ColumnType> {
                ::std::vec![#(#krate::table::ColumnType::of::<#col_tys>()),*]
            }
        }
    })
}

/// `#[fenced(table, schema, crate)]` and `#[sqlx(rename_all)]` on the struct.
fn parse_container(input: &DeriveInput, errors: &mut Errors) -> Container {
    let mut c = Container::default();
    for attr in &input.attrs {
        if attr.path().is_ident("fenced") {
            let parsed = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("table") {
                    c.table = Some(meta.value()?.parse()?);
                } else if meta.path.is_ident("schema") {
                    c.schema = Some(meta.value()?.parse()?);
                } else if meta.path.is_ident("crate") {
                    let lit: LitStr = meta.value()?.parse()?;
                    c.krate = Some(lit.parse()?);
                } else {
                    return Err(meta.error(
                        "unknown #[fenced] attribute on a struct: expected `table`, `schema` or `crate`",
                    ));
                }
                Ok(())
            });
            if let Err(e) = parsed {
                errors.push(e);
            }
        } else if attr.path().is_ident("sqlx") {
            for meta in sqlx_metas(attr, errors) {
                if let Meta::NameValue(nv) = &meta
                    && nv.path.is_ident("rename_all")
                {
                    match str_value(&nv.value).as_deref().map(RenameAll::parse) {
                        Some(Some(pattern)) => c.rename_all = Some(pattern),
                        _ => errors.push(Error::new_spanned(
                            &nv.value,
                            "unknown rename_all pattern (sqlx's are lowercase, snake_case, \
                             UPPERCASE, SCREAMING_SNAKE_CASE, kebab-case, camelCase, PascalCase)",
                        )),
                    }
                }
            }
        }
    }
    c
}

/// A field's column, or `None` when it is skipped (or wrong: the error is recorded).
fn parse_field<'a>(
    field: &'a syn::Field,
    ident: &'a Ident,
    container: &Container,
    errors: &mut Errors,
) -> Option<Column<'a>> {
    let mut key = false;
    let mut skip = false;
    let mut fenced_rename: Option<LitStr> = None;
    let mut sqlx_rename: Option<(String, Span)> = None;
    let mut sqlx_skip = false;
    let mut unsupported: Option<(&'static str, Span)> = None;
    for attr in &field.attrs {
        if attr.path().is_ident("fenced") {
            let parsed = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident("key") {
                    key = true;
                } else if meta.path.is_ident("skip") {
                    skip = true;
                } else if meta.path.is_ident("rename") {
                    fenced_rename = Some(meta.value()?.parse()?);
                } else {
                    return Err(meta.error(
                        "unknown #[fenced] attribute on a field: expected `key`, `skip` or `rename`",
                    ));
                }
                Ok(())
            });
            if let Err(e) = parsed {
                errors.push(e);
            }
        } else if attr.path().is_ident("sqlx") {
            for meta in sqlx_metas(attr, errors) {
                let path = meta.path();
                let span = syn::spanned::Spanned::span(&meta);
                if path.is_ident("skip") {
                    sqlx_skip = true;
                } else if path.is_ident("rename") {
                    match &meta {
                        Meta::NameValue(nv) => match str_value(&nv.value) {
                            Some(s) => sqlx_rename = Some((s, span)),
                            None => errors.push(Error::new(span, "expected rename = \"...\"")),
                        },
                        _ => errors.push(Error::new(span, "expected rename = \"...\"")),
                    }
                } else if path.is_ident("flatten") {
                    unsupported = Some(("flatten", span));
                } else if path.is_ident("json") {
                    unsupported = Some(("json", span));
                } else if path.is_ident("try_from") {
                    unsupported = Some(("try_from", span));
                }
            }
        }
    }
    if key && (skip || sqlx_skip) {
        errors.push(Error::new_spanned(ident, "a key field cannot be skipped"));
        return None;
    }
    if skip || sqlx_skip {
        return None;
    }
    if let Some((what, span)) = unsupported {
        errors.push(Error::new(
            span,
            format!(
                "#[derive(FencedTable)] cannot write a #[sqlx({what})] field: add #[fenced(skip)] \
                 (or declare the table with a hand-written FencedTable impl)"
            ),
        ));
        return None;
    }
    let name = match (&fenced_rename, &sqlx_rename) {
        (Some(f), Some((s, _))) if f.value() != *s => {
            errors.push(Error::new_spanned(
                f,
                format!(
                    "#[fenced(rename = \"{}\")] disagrees with #[sqlx(rename = \"{s}\")]: \
                     reads and writes would use different columns",
                    f.value()
                ),
            ));
            return None;
        }
        (Some(f), _) => f.value(),
        (None, Some((s, _))) => s.clone(),
        (None, None) => {
            let plain = ident.unraw().to_string();
            match container.rename_all {
                Some(pattern) => pattern.apply(&plain),
                None => plain,
            }
        }
    };
    let span = fenced_rename
        .as_ref()
        .map(LitStr::span)
        .or(sqlx_rename.as_ref().map(|(_, s)| *s))
        .unwrap_or_else(|| ident.span());
    if name == "fence" {
        errors.push(Error::new(
            span,
            "the `fence` column is written by pgfence: mark this field #[fenced(skip)] \
             (FromRow still reads it)",
        ));
        return None;
    }
    check_name(&name, span, errors);
    Some(Column {
        ident,
        ty: &field.ty,
        name,
        key,
    })
}

/// The items of a `#[sqlx(...)]` attribute (any shape sqlx accepts).
fn sqlx_metas(attr: &syn::Attribute, errors: &mut Errors) -> Vec<Meta> {
    match attr.parse_args_with(Punctuated::<Meta, Token![,]>::parse_terminated) {
        Ok(metas) => metas.into_iter().collect(),
        Err(e) => {
            errors.push(e);
            Vec::new()
        }
    }
}

fn str_value(expr: &Expr) -> Option<String> {
    match expr {
        Expr::Lit(ExprLit {
            lit: Lit::Str(s), ..
        }) => Some(s.value()),
        _ => None,
    }
}

/// The checks `pgfence::table::Ident::new` makes at run time, made at compile time.
fn check_name(name: &str, span: Span, errors: &mut Errors) {
    let reason = if name.is_empty() {
        Some("an empty name")
    } else if name.len() > MAX_IDENT_LEN {
        Some("longer than 63 bytes (Postgres would truncate it)")
    } else if name.contains('\0') {
        Some("contains a NUL byte")
    } else {
        None
    };
    if let Some(reason) = reason {
        errors.push(Error::new(
            span,
            format!("invalid SQL name {name:?}: {reason}"),
        ));
    }
}

impl RenameAll {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "lowercase" => Self::Lower,
            "snake_case" => Self::Snake,
            "UPPERCASE" => Self::Upper,
            "SCREAMING_SNAKE_CASE" => Self::ScreamingSnake,
            "kebab-case" => Self::Kebab,
            "camelCase" => Self::Camel,
            "PascalCase" => Self::Pascal,
            _ => return None,
        })
    }

    /// What sqlx (through `heck`) makes of a field name.
    fn apply(self, name: &str) -> String {
        let words = words(name);
        let capitalized = || -> Vec<String> { words.iter().map(|w| capitalize(w)).collect() };
        match self {
            Self::Lower => name.to_lowercase(),
            Self::Upper => name.to_uppercase(),
            Self::Snake => words.join("_"),
            Self::Kebab => words.join("-"),
            Self::ScreamingSnake => words
                .iter()
                .map(|w| w.to_uppercase())
                .collect::<Vec<_>>()
                .join("_"),
            Self::Pascal => capitalized().concat(),
            Self::Camel => {
                let mut out = words.first().cloned().unwrap_or_default();
                out.extend(capitalized().into_iter().skip(1));
                out
            }
        }
    }
}

/// Lower-case words of an identifier: split at `_`, `-` and lower-to-upper case changes.
fn words(name: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut current = String::new();
    let mut prev_lower = false;
    for ch in name.chars() {
        if ch == '_' || ch == '-' {
            if !current.is_empty() {
                words.push(std::mem::take(&mut current));
            }
            prev_lower = false;
            continue;
        }
        if ch.is_uppercase() && prev_lower && !current.is_empty() {
            words.push(std::mem::take(&mut current));
        }
        prev_lower = ch.is_lowercase() || ch.is_ascii_digit();
        current.extend(ch.to_lowercase());
    }
    if !current.is_empty() {
        words.push(current);
    }
    words
}

fn capitalize(word: &str) -> String {
    let mut chars = word.chars();
    chars
        .next()
        .map(|first| first.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand_str(input: DeriveInput) -> Result<String, String> {
        expand(&input)
            .map(|t| t.to_string())
            .map_err(|e| e.to_string())
    }

    #[test]
    fn rename_all_matches_sqlx_for_field_names() {
        let cases = [
            (RenameAll::Lower, "line_item", "line_item"),
            (RenameAll::Upper, "line_item", "LINE_ITEM"),
            (RenameAll::Snake, "line_item", "line_item"),
            (RenameAll::Kebab, "line_item", "line-item"),
            (RenameAll::ScreamingSnake, "line_item", "LINE_ITEM"),
            (RenameAll::Camel, "line_item_2", "lineItem2"),
            (RenameAll::Pascal, "line_item", "LineItem"),
            (RenameAll::Snake, "lineItem", "line_item"),
        ];
        for (pattern, field, column) in cases {
            assert_eq!(pattern.apply(field), column, "{pattern:?} {field}");
        }
    }

    #[test]
    fn composite_key_renames_and_skips() {
        let out = expand_str(syn::parse_quote! {
            #[fenced(schema = "billing", table = "ledger_line")]
            #[sqlx(rename_all = "camelCase")]
            struct Line {
                #[fenced(key)] batch_id: i64,
                #[fenced(key)] line: i32,
                #[sqlx(rename = "amt")] amount: i64,
                paid_by: Option<String>,
                #[fenced(skip)] fence: i64,
                #[sqlx(skip)] cache: Vec<u8>,
            }
        })
        .unwrap();
        assert!(out.contains("type Key = (i64 , i32 ,)"), "{out}");
        assert!(out.contains("const SCHEMA : & 'static str = \"billing\""));
        assert!(
            out.contains("KEY_COLUMNS : & 'static [& 'static str] = & [\"batchId\" , \"line\"]")
        );
        assert!(out.contains("COLUMNS : & 'static [& 'static str] = & [\"amt\" , \"paidBy\"]"));
        assert!(!out.contains("cache"));
    }

    #[test]
    fn mistakes_are_compile_errors() {
        let err = |input: DeriveInput| expand_str(input).unwrap_err();
        assert!(
            err(syn::parse_quote!(
                struct T {
                    #[fenced(key)]
                    id: i64,
                }
            ))
            .contains("table")
        );
        assert!(
            err(syn::parse_quote!(
                #[fenced(table = "t")]
                struct T {
                    id: i64,
                }
            ))
            .contains("no key")
        );
        assert!(
            err(syn::parse_quote!(
                #[fenced(table = "t")]
                struct T {
                    #[fenced(key)]
                    id: i64,
                    fence: i64,
                }
            ))
            .contains("fence")
        );
        assert!(
            err(syn::parse_quote!(
                #[fenced(table = "t")]
                struct T {
                    #[fenced(key)]
                    id: i64,
                    #[fenced(rename = "a")]
                    #[sqlx(rename = "b")]
                    x: i64,
                }
            ))
            .contains("disagrees")
        );
        assert!(
            err(syn::parse_quote!(
                #[fenced(table = "t")]
                struct T {
                    #[fenced(key)]
                    id: i64,
                    a: i64,
                    #[sqlx(rename = "a")]
                    b: i64,
                }
            ))
            .contains("declared twice")
        );
        assert!(
            err(syn::parse_quote!(
                #[fenced(table = "t")]
                struct T {
                    #[fenced(key)]
                    id: i64,
                    #[sqlx(json)]
                    doc: String,
                }
            ))
            .contains("json")
        );
        assert!(
            err(syn::parse_quote!(
                #[fenced(tabel = "t")]
                struct T {
                    #[fenced(key)]
                    id: i64,
                }
            ))
            .contains("unknown")
        );
    }
}
