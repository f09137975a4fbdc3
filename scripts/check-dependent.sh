#!/usr/bin/env bash
# Builds a tiny crate that depends on pgfence, the way a service would, with DATABASE_URL
# (1) unset, (2) set to a database without pgfence's schema, (3) set to an unreachable
# server. pgfence's query macros must use its shipped offline data in every case (sqlx.toml
# points them at PGFENCE_DATABASE_URL). pgfence itself is rebuilt for each case.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dir=$(mktemp -d /tmp/pgfence-dependent.XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/src"
cat > "$dir/Cargo.toml" <<TOML
[package]
name = "pgfence-dependent-check"
version = "0.0.0"
edition = "2024"
publish = false

[dependencies]
pgfence = { path = "$repo" }
sqlx = { version = "0.9", default-features = false, features = ["runtime-tokio", "postgres"] }

[workspace]
TOML
cat > "$dir/src/main.rs" <<'RS'
//! A service that depends on pgfence.
fn main() {
    let token = pgfence::FenceToken::new(1).expect("a token");
    let _check = pgfence::admin::high_water::<&sqlx::PgPool>;
    println!("built against pgfence; token {token}");
}
RS
export CARGO_TARGET_DIR="$repo/target/dependent-check"
unset SQLX_OFFLINE SQLX_OFFLINE_DIR PGFENCE_DATABASE_URL
admin=${ADMIN_URL:-postgres://postgres@127.0.0.1/postgres}
build() {
  echo "-- dependent build with DATABASE_URL ${1:-unset}"
  cargo clean -q -p pgfence --manifest-path "$dir/Cargo.toml" 2>/dev/null || true
  if [ -n "${1:-}" ]; then
    DATABASE_URL="$1" cargo build -q --manifest-path "$dir/Cargo.toml"
  else
    env -u DATABASE_URL cargo build -q --manifest-path "$dir/Cargo.toml"
  fi
}
build ""
if psql "$admin" -qAtc "SELECT 1" >/dev/null 2>&1; then
  psql "$admin" -qc "DROP DATABASE IF EXISTS pgfence_dependent_empty" -c "CREATE DATABASE pgfence_dependent_empty"
  build "${admin%/*}/pgfence_dependent_empty"
  psql "$admin" -qc "DROP DATABASE pgfence_dependent_empty"
else
  echo "-- no PostgreSQL at $admin: the 'database without the schema' case is skipped"
fi
build "postgres://app@127.0.0.1:1/unreachable"
echo "dependent crate builds in every DATABASE_URL case"
