-- Rollout and maintenance for guarded tables.
--
-- * Observe mode: `pgfence.guard(schema, table, 'observe')` installs the guard trigger in
--   report-only mode. An UPDATE that does not advance the fence is let through, recorded in
--   pgfence.audit (operation 'observe', holder = the writing role, application_name) and
--   logged by PostgreSQL with a WARNING. `pgfence.guard(schema, table, 'enforce')` switches
--   to enforcing; the two-argument `pgfence.guard(schema, table)` enforces, as before. The
--   mode is the trigger's argument (`EXECUTE FUNCTION pgfence.reject_stale_update('observe')`;
--   an enforcing trigger has none, like every trigger installed before this migration), so
--   the hot path keeps its shape: `WHEN (NEW.fence <= OLD.fence)`, no PL/pgSQL call for a
--   write that advances the fence. Switching modes replaces the trigger.
-- * An explicit, audited bypass for maintenance: inside a transaction,
--   `SET LOCAL pgfence.bypass = 'refund #123'` lets that transaction's non-advancing UPDATEs
--   of guarded tables through, for a role the schema owner allowed
--   (`SELECT pgfence.allow_bypass('billing_admin')`; a member of an allowed role is allowed;
--   superusers only when listed, like anyone). Each bypassed row gets an audit row (operation
--   'bypass', holder = the role, reason = the setting) and a WARNING, and its fence is sealed:
--   the sequence bits are set to their maximum, so the lease that last wrote or claimed the
--   row cannot write it again (it gets PF005 / LeaseExhausted and must take a new lease,
--   re-reading the row), and the maintenance change is not overwritten by a holder that read
--   the row before it. A bypass by any other role is rejected like a stale write (PF001), and
--   the message says why.
-- * pgfence.guarded_table remembers which tables were guarded, so `pgfence doctor` can tell
--   a guard trigger that was dropped behind pgfence's back.
--
-- "The role" is the session's current role outside any SECURITY DEFINER function: the
-- `role` setting after SET ROLE, otherwise session_user. The trigger function runs with its
-- owner's rights (it writes pgfence.audit for writers that have no privilege on pgfence's
-- schema, and reads pgfence.bypass_role), so current_user inside it is its owner.

-- Who changed a row outside the fencing protocol, and why.
ALTER TABLE pgfence.audit ADD COLUMN application_name text;
-- A separate statement, so rows written before this migration keep NULL.
ALTER TABLE pgfence.audit ALTER COLUMN application_name
    SET DEFAULT pg_catalog.current_setting('application_name', true);
ALTER TABLE pgfence.audit ADD COLUMN reason text;

-- Roles allowed to bypass the guard with `SET LOCAL pgfence.bypass = '<reason>'`.
CREATE TABLE pgfence.bypass_role (
    role       text        PRIMARY KEY CHECK (length(role) BETWEEN 1 AND 63),
    added_at   timestamptz NOT NULL DEFAULT now(),
    added_by   text        NOT NULL DEFAULT current_user
);

-- Tables pgfence.guard guarded (until pgfence.unguard), by oid: a renamed table stays
-- known, a dropped one is ignored.
CREATE TABLE pgfence.guarded_table (
    rel        oid         PRIMARY KEY,
    guarded_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO pgfence.guarded_table (rel)
SELECT t.tgrelid FROM pg_trigger t WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal
ON CONFLICT DO NOTHING;

-- The mode of a guard trigger, from its arguments: 'observe' or 'enforce'.
CREATE FUNCTION pgfence.trigger_mode(p_nargs smallint, p_args bytea) RETURNS text
LANGUAGE sql IMMUTABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT CASE WHEN p_nargs > 0
                 AND split_part(encode(p_args, 'escape'), E'\\000', 1) = 'observe'
                THEN 'observe' ELSE 'enforce' END
$$;

-- Whether role p_role (a name) is, or is a member of, a role in pgfence.bypass_role.
-- Superusers get no free pass: they must be listed (or be members of a listed role).
CREATE FUNCTION pgfence.may_bypass(p_role text) RETURNS boolean
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    WITH RECURSIVE m(oid) AS (
        SELECT r.oid FROM pg_roles r WHERE r.rolname = p_role
        UNION
        SELECT a.roleid FROM pg_auth_members a JOIN m ON a.member = m.oid
    )
    SELECT EXISTS (SELECT 1 FROM pgfence.bypass_role b
                     JOIN pg_roles r ON r.rolname = b.role
                     JOIN m ON m.oid = r.oid)
$$;

-- The guard trigger. Runs only for an UPDATE that does not advance the fence (the trigger's
-- WHEN clause). Enforcing (no argument): raises PF001, unless the transaction set
-- pgfence.bypass and the role may bypass. Observing ('observe'): lets the write through,
-- audited. Never builds SQL from values: the row key (JSON array of the primary key) is
-- read with a statement naming the key columns, and only when all of them have built-in
-- types, so no user-defined cast or output function runs with the owner's rights.
CREATE OR REPLACE FUNCTION pgfence.reject_stale_update() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_observe boolean := TG_NARGS > 0 AND TG_ARGV[0] = 'observe';
    v_reason text := nullif(btrim(current_setting('pgfence.bypass', true)), '');
    v_role text := CASE WHEN current_setting('role') = 'none' THEN session_user::text
                        ELSE current_setting('role') END;
    v_app text := current_setting('application_name', true);
    v_table text := format('%I.%I', TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_allowed boolean := false;
    v_note text;
    v_cols text;
    v_builtin boolean;
    v_key text;
BEGIN
    IF v_reason IS NOT NULL THEN
        v_allowed := pgfence.may_bypass(v_role);
        IF NOT v_allowed THEN
            v_note := format('bypass %L refused: role %I may not bypass the guard (the schema owner runs pgfence.allow_bypass(role))',
                             v_reason, v_role);
            IF NOT v_observe THEN
                RAISE EXCEPTION 'pgfence: stale fence on %: presented token %, current token %: %',
                        v_table, NEW.fence >> 24, OLD.fence >> 24, v_note
                    USING ERRCODE = 'PF001',
                          DETAIL = format('presented=%s current=%s table=%s',
                                          NEW.fence >> 24, OLD.fence >> 24, v_table),
                          HINT = 'ask the schema owner to run pgfence.allow_bypass for this role, or write under a lease (pgfence run, pgfence.next_fence)',
                          SCHEMA = TG_TABLE_SCHEMA,
                          TABLE = TG_TABLE_NAME,
                          COLUMN = 'fence';
            END IF;
        END IF;
    ELSIF NOT v_observe THEN
        RAISE EXCEPTION 'pgfence: stale fence on %: presented token %, current token % (every UPDATE of a guarded table must advance fence)',
                v_table, NEW.fence >> 24, OLD.fence >> 24
            USING ERRCODE = 'PF001',
                  DETAIL = format('presented=%s current=%s table=%s',
                                  NEW.fence >> 24, OLD.fence >> 24, v_table),
                  HINT = 'set fence = pgfence.next_fence(fence, <token>, <tag>), or write through the pgfence repository',
                  SCHEMA = TG_TABLE_SCHEMA,
                  TABLE = TG_TABLE_NAME,
                  COLUMN = 'fence';
    END IF;

    -- Let through: a bypass by an allowed role, or observe mode. Say which row.
    SELECT string_agg(format('($1).%I', a.attname), ', ' ORDER BY k.ord),
           bool_and(a.atttypid < 16384)
      INTO v_cols, v_builtin
      FROM pg_index i
     CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
     WHERE i.indrelid = TG_RELID AND i.indisprimary;
    IF v_cols IS NOT NULL AND v_builtin THEN
        EXECUTE format('SELECT pg_catalog.jsonb_build_array(%s)::pg_catalog.text', v_cols)
           INTO v_key USING OLD;
    END IF;

    IF v_allowed THEN
        -- Seal the row against the lease that last wrote it (see the header).
        NEW.fence := greatest(NEW.fence, OLD.fence | 4095);
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, NEW.fence >> 24, OLD.fence >> 24, v_role, 'bypass', v_app, v_reason);
        RAISE WARNING 'pgfence: guard bypassed on % row % by role % (application %): %',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''), v_reason
            USING DETAIL = format('presented=%s current=%s table=%s', NEW.fence >> 24, OLD.fence >> 24, v_table);
    ELSE
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, NEW.fence >> 24, OLD.fence >> 24, v_role, 'observe', v_app, v_note);
        RAISE WARNING 'pgfence: observe mode: unfenced update of % row % by role % (application %) would be rejected when enforcing%',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''),
                CASE WHEN v_note IS NULL THEN '' ELSE '; ' || v_note END
            USING DETAIL = format('presented=%s current=%s table=%s', NEW.fence >> 24, OLD.fence >> 24, v_table),
                  HINT = 'write under a lease (pgfence run, pgfence.next_fence), or set pgfence.bypass as an allowed role';
    END IF;
    RETURN NEW;
END
$$;

-- Guards a table in mode p_mode ('enforce' or 'observe'): like the two-argument guard (adds
-- or adopts the fence column, refuses pgfence's and system tables), then installs the
-- trigger in that mode, switches an installed trigger to it, and re-enables a disabled one.
-- Returns true when something changed.
CREATE FUNCTION pgfence.guard(p_schema text, p_table text, p_mode text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel regclass;
    col_type text;
    col_notnull boolean;
    changed boolean := false;
    v_trigger record;
    v_create text;
BEGIN
    IF p_mode IS NULL OR p_mode NOT IN ('enforce', 'observe') THEN
        RAISE EXCEPTION 'pgfence: guard modes are enforce and observe, got %', p_mode
            USING ERRCODE = '22023';
    END IF;
    IF p_schema IN ('pgfence', 'information_schema') OR p_schema LIKE 'pg\_%' THEN
        RAISE EXCEPTION 'pgfence: refusing to guard %.%: pgfence and system tables cannot be guarded',
                quote_ident(p_schema), quote_ident(p_table)
            USING ERRCODE = 'PF003', SCHEMA = p_schema, TABLE = format('%I.%I', p_schema, p_table);
    END IF;
    v_rel := pgfence.resolve_table(p_schema, p_table);

    -- Self-conflicting lock: concurrent guards of one table run one after the other.
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', v_rel);

    SELECT format_type(a.atttypid, a.atttypmod), a.attnotnull INTO col_type, col_notnull
      FROM pg_attribute a
     WHERE a.attrelid = v_rel AND a.attname = 'fence' AND NOT a.attisdropped;

    IF col_type IS NULL THEN
        EXECUTE format('ALTER TABLE %s ADD COLUMN fence bigint NOT NULL DEFAULT 0', v_rel);
        changed := true;
    ELSIF col_type <> 'bigint' THEN
        RAISE EXCEPTION 'pgfence: %.fence has type %, expected bigint', v_rel, col_type
            USING ERRCODE = 'PF002', DETAIL = col_type, SCHEMA = p_schema, TABLE = v_rel::text;
    ELSIF NOT col_notnull THEN
        EXECUTE format('UPDATE %s SET fence = 0 WHERE fence IS NULL', v_rel);
        EXECUTE format('ALTER TABLE %s ALTER COLUMN fence SET DEFAULT 0, ALTER COLUMN fence SET NOT NULL', v_rel);
        changed := true;
    END IF;

    v_create := format(
        'TRIGGER pgfence_guard BEFORE UPDATE ON %s FOR EACH ROW '
        'WHEN (NEW.fence OPERATOR(pg_catalog.<=) OLD.fence) '
        'EXECUTE FUNCTION pgfence.reject_stale_update(%s)', v_rel,
        CASE p_mode WHEN 'observe' THEN '''observe''' ELSE '' END);
    SELECT t.tgnargs, t.tgargs, t.tgenabled INTO v_trigger
      FROM pg_trigger t WHERE t.tgrelid = v_rel AND t.tgname = 'pgfence_guard';
    IF NOT FOUND THEN
        EXECUTE 'CREATE ' || v_create;
        changed := true;
    ELSIF pgfence.trigger_mode(v_trigger.tgnargs, v_trigger.tgargs) <> p_mode THEN
        IF current_setting('server_version_num')::integer >= 140000 THEN
            EXECUTE 'CREATE OR REPLACE ' || v_create;
        ELSE
            EXECUTE format('DROP TRIGGER pgfence_guard ON %s', v_rel);
            EXECUTE 'CREATE ' || v_create;
        END IF;
        changed := true;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = v_rel AND t.tgname = 'pgfence_guard'
                  AND t.tgenabled NOT IN ('O', 'A')) THEN
        EXECUTE format('ALTER TABLE %s ENABLE TRIGGER pgfence_guard', v_rel);
        changed := true;
    END IF;
    INSERT INTO pgfence.guarded_table (rel) VALUES (v_rel::oid) ON CONFLICT DO NOTHING;
    RETURN changed;
END
$$;

-- The two-argument guard enforces (and switches an observing table to enforcing).
CREATE OR REPLACE FUNCTION pgfence.guard(p_schema text, p_table text) RETURNS boolean
LANGUAGE sql
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT pgfence.guard(p_schema, p_table, 'enforce')
$$;

-- Unguard also forgets the table (so doctor does not miss its trigger).
CREATE OR REPLACE FUNCTION pgfence.unguard(p_schema text, p_table text, p_drop_column boolean DEFAULT false)
RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel regclass := pgfence.resolve_table(p_schema, p_table);
    changed boolean := false;
BEGIN
    EXECUTE format('LOCK TABLE %s IN SHARE ROW EXCLUSIVE MODE', v_rel);
    IF EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = v_rel AND tgname = 'pgfence_guard') THEN
        EXECUTE format('DROP TRIGGER pgfence_guard ON %s', v_rel);
        changed := true;
    END IF;
    IF p_drop_column AND EXISTS (SELECT 1 FROM pg_attribute
                                  WHERE attrelid = v_rel AND attname = 'fence' AND NOT attisdropped) THEN
        EXECUTE format('ALTER TABLE %s DROP COLUMN fence', v_rel);
        changed := true;
    END IF;
    DELETE FROM pgfence.tombstone t WHERE t.rel = v_rel::oid;
    DELETE FROM pgfence.guarded_table g WHERE g.rel = v_rel::oid;
    RETURN changed;
END
$$;

-- Guarded tables with their mode and whether the trigger fires (new columns at the end).
CREATE OR REPLACE VIEW pgfence.guarded_tables AS
SELECT n.nspname::text AS schema_name, c.relname::text AS table_name,
       pgfence.trigger_mode(t.tgnargs, t.tgargs) AS mode,
       t.tgenabled IN ('O', 'A') AS enabled
  FROM pg_trigger t
  JOIN pg_class c ON c.oid = t.tgrelid
  JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal;

-- Owner-only: allow or disallow a role to bypass the guard. allow_bypass raises 42704 for a
-- role that does not exist; both return true when something changed.
CREATE FUNCTION pgfence.allow_bypass(p_role text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pg_roles r WHERE r.rolname = p_role) THEN
        RAISE EXCEPTION 'pgfence: role % does not exist', quote_ident(p_role) USING ERRCODE = '42704';
    END IF;
    INSERT INTO pgfence.bypass_role (role) VALUES (p_role) ON CONFLICT DO NOTHING;
    RETURN FOUND;
END
$$;

CREATE FUNCTION pgfence.disallow_bypass(p_role text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    DELETE FROM pgfence.bypass_role WHERE role = p_role;
    RETURN FOUND;
END
$$;

-- Deny by default, as V5 does for everything before it.
REVOKE ALL ON pgfence.bypass_role, pgfence.guarded_table FROM PUBLIC;
REVOKE ALL ON FUNCTION pgfence.trigger_mode(smallint, bytea), pgfence.may_bypass(text),
    pgfence.guard(text, text, text), pgfence.allow_bypass(text), pgfence.disallow_bypass(text)
    FROM PUBLIC;
