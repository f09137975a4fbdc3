//! The issuer's Lua scripts, loaded once and called by SHA (redis-rs reloads a script a
//! restarted server no longer has).

use std::sync::LazyLock;

use redis::Script;

pub(super) static ACQUIRE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/acquire.lua")));
pub(super) static RELEASE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/release.lua")));
pub(super) static EXTEND: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/extend.lua")));
pub(super) static RAISE_FLOOR: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/raise_floor.lua")));
pub(super) static REISSUE: LazyLock<Script> =
    LazyLock::new(|| Script::new(include_str!("lua/reissue.lua")));
/// The clean-up of a failed acquire (sent with `SCRIPT LOAD` in one write on a single server).
pub(super) const ABANDON_SOURCE: &str = include_str!("lua/abandon.lua");
pub(super) static ABANDON: LazyLock<Script> = LazyLock::new(|| Script::new(ABANDON_SOURCE));
