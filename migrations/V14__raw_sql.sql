-- V14 (unreleased, folded into the 0.3 migration): hand-written SQL in the write-up's form
-- works as written, and the guard says what kind of write it refused.

-- The 12-bit tag of a fence (counter << 8 | holder).
CREATE OR REPLACE FUNCTION pgfence.fence_tag(p_fence bigint) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
    SELECT ((p_fence OPERATOR(pg_catalog.>>) pgfence.tag_shift())
            OPERATOR(pg_catalog.&) pgfence.max_tag())::integer
$$;
REVOKE ALL ON FUNCTION pgfence.fence_tag(bigint) FROM PUBLIC;

CREATE OR REPLACE FUNCTION pgfence.reject_stale_update() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_observe boolean := TG_NARGS > 0 AND TG_ARGV[0] = 'observe';
    v_reason text := nullif(btrim(current_setting('pgfence.bypass', true)), '');
    v_xact_ok boolean := coalesce(current_setting('pgfence.bypass_xact', true) = txid_current()::text, false);
    v_role text := CASE WHEN current_setting('role') = 'none' THEN session_user::text
                        ELSE current_setting('role') END;
    v_app text := current_setting('application_name', true);
    v_table text := pgfence.quoted_table(TG_TABLE_SCHEMA, TG_TABLE_NAME);
    v_advanced boolean := NEW.fence > OLD.fence;
    v_allowed boolean := false;
    v_note text;
    v_cols text;
    v_builtin boolean;
    v_key text;
    v_old bigint := OLD.fence;
BEGIN
    -- A token absurdly far ahead: refused in every mode.
    PERFORM pgfence.refuse_token_jump(pgfence.fence_token(OLD.fence), pgfence.fence_token(NEW.fence), 'table=' || v_table);
    -- A hand-written write in the write-up's form, `SET fence = $f ... WHERE ... AND fence < $f`
    -- with $f the lease's fence for SQL (Lease::fence(), PGFENCE_FENCE: its token and tag with
    -- every sequence bit set, above each fence the lease itself stores and below every newer
    -- lease's). It stores what the lease's write stores (next_fence: its first fence on a row
    -- an older lease wrote, the next step of its cycle on a row it wrote), or raises as
    -- next_fence does (PF001 stale, PF004 duplicate, PF005 sealed), so the same statement
    -- serves every write of the lease.
    IF pgfence.fence_sequence(NEW.fence) = pgfence.sealed_sequence()
       AND pgfence.fence_token(NEW.fence) > 0 AND NEW.fence <> OLD.fence THEN
        NEW.fence := pgfence.next_fence(OLD.fence, pgfence.fence_token(NEW.fence),
                                        pgfence.fence_tag(NEW.fence), v_table);
        RETURN NEW;
    END IF;
    -- A lease's write that the WHEN clause's filter did not recognise (a fresh row's first
    -- token beyond the bound): let through.
    IF (pgfence.fence_token(NEW.fence) > pgfence.fence_token(OLD.fence)
        AND pgfence.fence_sequence(NEW.fence) = 0)
       OR NEW.fence = pgfence.next_step(OLD.fence) THEN
        RETURN NEW;
    END IF;
    IF v_reason IS NOT NULL AND NOT v_xact_ok THEN
        v_note := 'pgfence.bypass was not set by pgfence.bypass() in this transaction (a plain SET outlives its transaction)';
        IF NOT v_observe THEN
            RAISE EXCEPTION 'pgfence: bypass refused on %: %', v_table, v_note
                USING ERRCODE = 'PF006',
                      DETAIL = format('role=%s reason=%s', v_role, v_reason),
                      HINT = 'BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
    ELSIF v_reason IS NOT NULL THEN
        v_allowed := pgfence.may_bypass(v_role);
        IF NOT v_allowed THEN
            v_note := format('role %I may not bypass the guard (the schema owner runs pgfence.allow_bypass(role))',
                             v_role);
            IF NOT v_observe THEN
                RAISE EXCEPTION 'pgfence: bypass refused on %: %', v_table, v_note
                    USING ERRCODE = 'PF006',
                          DETAIL = format('role=%s reason=%s', v_role, v_reason),
                          HINT = 'ask the schema owner to run pgfence.allow_bypass for this role, or write under a lease (pgfence run, pgfence.next_fence)',
                          SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
            END IF;
        END IF;
    ELSIF NOT v_observe THEN
        IF NEW.fence = OLD.fence THEN
            RAISE EXCEPTION 'pgfence: lease-less write refused on %: the UPDATE left fence as it was (every UPDATE of a guarded table is a lease''s write, which advances it, or an audited bypass); this rejection is recorded only in the PostgreSQL server log',
                    v_table
                USING ERRCODE = 'PF007',
                      DETAIL = format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table),
                      HINT = 'under a lease: SET fence = $PGFENCE_FENCE (Lease::fence()) or fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG); a maintenance write: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        IF pgfence.fence_token(NEW.fence) = 0 AND NEW.fence > 0 THEN
            -- SET fence = <a token>: tokens are not fences (the write-up's `fence < $token`
            -- compares a token with the stored fence, which packs the token with more).
            RAISE EXCEPTION 'pgfence: % on %: fence % is a fence token, not a fence (a stored fence packs the token with a tag and a sequence); this rejection is recorded only in the PostgreSQL server log',
                    CASE WHEN v_advanced THEN 'lease-less write refused' ELSE 'stale fence' END,
                    v_table, NEW.fence
                USING ERRCODE = CASE WHEN v_advanced THEN 'PF007' ELSE 'PF001' END,
                      DETAIL = CASE WHEN v_advanced
                                    THEN format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table)
                                    ELSE format('presented=%s current=%s table=%s', 0,
                                                pgfence.fence_token(OLD.fence), v_table) END,
                      HINT = 'write SET fence = $PGFENCE_FENCE ... AND fence < $PGFENCE_FENCE (Lease::fence() in Rust), not $PGFENCE_TOKEN: docs/sql.md, "Porting hand-written fenced SQL"',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        IF v_advanced THEN
            RAISE EXCEPTION 'pgfence: lease-less write refused on %: fence % -> % is not a lease''s write (fence = fence + n is not one); this rejection is recorded only in the PostgreSQL server log',
                    v_table, OLD.fence, NEW.fence
                USING ERRCODE = 'PF007',
                      DETAIL = format('old=%s new=%s table=%s', OLD.fence, NEW.fence, v_table),
                      HINT = 'write under a lease (pgfence run; SET fence = $PGFENCE_FENCE, or fence = pgfence.next_fence(fence, $PGFENCE_TOKEN, $PGFENCE_TAG)), or as an allowed role: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                      SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
        END IF;
        RAISE EXCEPTION 'pgfence: stale fence on %: presented token %, current token % (every UPDATE of a guarded table must be a lease''s write); this rejection is recorded only in the PostgreSQL server log',
                v_table, pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence)
            USING ERRCODE = 'PF001',
                  DETAIL = format('presented=%s current=%s table=%s',
                                  pgfence.fence_token(NEW.fence), pgfence.fence_token(OLD.fence), v_table),
                  HINT = 'set fence = $PGFENCE_FENCE (Lease::fence()) or pgfence.next_fence(fence, <token>, <tag>) under a lease (pgfence run), write through the pgfence repository, or bypass: BEGIN; SELECT pgfence.bypass(''<reason>''); UPDATE ...; COMMIT;',
                  SCHEMA = TG_TABLE_SCHEMA, TABLE = TG_TABLE_NAME, COLUMN = 'fence';
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

    -- Seal the row against every lease that wrote it before (see the header): the lease
    -- whose fence the row had cannot write it again, and neither can anything older. A fence
    -- of a newer token set by hand is sealed too.
    NEW.fence := CASE WHEN pgfence.fence_token(NEW.fence) > pgfence.fence_token(v_old)
                      THEN pgfence.sealed_fence(NEW.fence)
                      ELSE pgfence.sealed_fence(v_old) END;

    IF v_allowed THEN
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_role, 'bypass', v_app, v_reason);
        RAISE WARNING 'pgfence: guard bypassed on % row % by role % (application %): %',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''), v_reason
            USING DETAIL = format('presented=%s current=%s table=%s', pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_table);
    ELSE
        INSERT INTO pgfence.audit (table_name, row_key, presented, current, holder, operation,
                                   application_name, reason)
        VALUES (v_table, v_key, pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_role, 'observe', v_app,
                CASE WHEN v_note IS NOT NULL
                     THEN format('bypass %L refused: %s', v_reason, v_note) END);
        RAISE WARNING 'pgfence: observe mode: unfenced update of % row % by role % (application %) would be rejected when enforcing (row sealed against earlier leases)%',
                v_table, coalesce(v_key, '?'), v_role, coalesce(v_app, ''),
                CASE WHEN v_note IS NULL THEN '' ELSE '; ' || v_note END
            USING DETAIL = format('presented=%s current=%s table=%s', pgfence.fence_token(NEW.fence), pgfence.fence_token(v_old), v_table),
                  HINT = 'write under a lease (pgfence run, pgfence.next_fence), or as an allowed role: SELECT pgfence.bypass(''<reason>'') in the transaction';
    END IF;
    RETURN NEW;
END
$$;

CREATE OR REPLACE FUNCTION pgfence.guard_trigger_ddl(p_rel regclass, p_mode text) RETURNS text
LANGUAGE sql STABLE
SET search_path = pg_catalog, pg_temp
AS $$
    SELECT format(
        'TRIGGER pgfence_guard BEFORE UPDATE ON %s FOR EACH ROW '
        'WHEN ((NEW.fence OPERATOR(pg_catalog.<=) (OLD.fence OPERATOR(pg_catalog.|) %s::pg_catalog.int8) '
        'AND (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.<>) ALL (''{%s,%s}''::pg_catalog.int8[])) '
        'OR (NEW.fence OPERATOR(pg_catalog.-) OLD.fence) OPERATOR(pg_catalog.>) %s::pg_catalog.int8 '
        'OR (NEW.fence OPERATOR(pg_catalog.&) %s::pg_catalog.int8) OPERATOR(pg_catalog.=) %s::pg_catalog.int8) '
        'EXECUTE FUNCTION pgfence.reject_stale_update(%s)', p_rel,
        pgfence.token_fence(1) - 1,
        pgfence.sequence_step(), pgfence.sequence_step() - pgfence.sealed_sequence(),
        pgfence.token_fence(pgfence.max_token_jump()),
        pgfence.sealed_sequence(), pgfence.sealed_sequence(),
        CASE p_mode WHEN 'observe' THEN '''observe''' ELSE '' END)
$$;

CREATE OR REPLACE FUNCTION pgfence.effect_begin(p_resource text, p_work_key text, p_step text,
                                     p_token bigint, p_tag integer, p_holder text)
RETURNS TABLE (status text, idempotency_key text, state text, outcome jsonb, holders integer,
               current bigint, other_counter boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_scope text := pgfence.issuer_counter_id(p_resource);
    v_mark bigint;
    v_row pgfence.effect;
    v_code text;
    v_detail text;
BEGIN
    PERFORM pgfence.effect_check_args(p_resource, p_work_key, p_step);
    -- A newer lease already checked the resource: fenced out before the call.
    v_mark := pgfence.high_water(p_resource);
    IF v_mark > p_token THEN
        RETURN QUERY SELECT 'stale'::text, NULL::text, NULL::text, NULL::jsonb, NULL::integer,
                            v_mark, false;
        RETURN;
    END IF;
    BEGIN
        INSERT INTO pgfence.effect AS e (scope, work_key, step, idempotency_key, fence,
                                         resource, holder)
        VALUES (v_scope, p_work_key, p_step, gen_random_uuid()::text,
                pgfence.lease_fence(p_token, p_tag), p_resource, p_holder)
        ON CONFLICT (scope, work_key, step) DO UPDATE
            SET fence = pgfence.next_fence(e.fence, p_token, p_tag, '"pgfence"."effect"'),
                holders = e.holders + CASE WHEN pgfence.fence_token(e.fence) < p_token THEN 1 ELSE 0 END,
                resource = p_resource,
                holder = p_holder,
                updated_at = clock_timestamp()
        RETURNING e.* INTO v_row;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' THEN
        GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
        RETURN QUERY SELECT CASE v_code WHEN 'PF001' THEN 'stale'
                                        WHEN 'PF004' THEN 'duplicate'
                                        ELSE 'exhausted' END,
                            NULL::text, NULL::text, NULL::jsonb, NULL::integer,
                            substring(v_detail FROM 'current=([0-9]+)')::bigint,
                            strpos(v_detail, 'origin=other') > 0;
        RETURN;
    END;
    RETURN QUERY SELECT 'ok'::text, v_row.idempotency_key, v_row.state, v_row.outcome,
                        v_row.holders, pgfence.fence_token(v_row.fence), false;
END
$$;

CREATE OR REPLACE FUNCTION pgfence.effect_finish(p_resource text, p_work_key text, p_step text,
                                      p_token bigint, p_tag integer, p_holder text,
                                      p_succeeded boolean, p_outcome jsonb)
RETURNS TABLE (status text, current bigint, other_counter boolean)
LANGUAGE plpgsql
SECURITY DEFINER
SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off
AS $$
DECLARE
    v_scope text := pgfence.issuer_counter_id(p_resource);
    v_mark bigint;
    v_code text;
    v_detail text;
BEGIN
    PERFORM pgfence.effect_check_args(p_resource, p_work_key, p_step);
    IF p_succeeded IS NULL THEN
        RAISE EXCEPTION 'pgfence: effect_finish needs p_succeeded' USING ERRCODE = '22023';
    END IF;
    v_mark := pgfence.high_water(p_resource);
    IF v_mark > p_token THEN
        RETURN QUERY SELECT 'stale'::text, v_mark, false;
        RETURN;
    END IF;
    BEGIN
        UPDATE pgfence.effect e
           SET fence = pgfence.next_fence(e.fence, p_token, p_tag, '"pgfence"."effect"'),
               state = CASE WHEN p_succeeded THEN 'succeeded' ELSE 'failed' END,
               outcome = p_outcome,
               resource = p_resource,
               holder = p_holder,
               updated_at = clock_timestamp()
         WHERE e.scope = v_scope AND e.work_key = p_work_key AND e.step = p_step;
        IF NOT FOUND THEN
            RETURN QUERY SELECT 'missing'::text, NULL::bigint, false;
            RETURN;
        END IF;
    EXCEPTION WHEN SQLSTATE 'PF001' OR SQLSTATE 'PF004' OR SQLSTATE 'PF005' THEN
        GET STACKED DIAGNOSTICS v_code = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
        RETURN QUERY SELECT CASE v_code WHEN 'PF001' THEN 'stale'
                                        WHEN 'PF004' THEN 'duplicate'
                                        ELSE 'exhausted' END,
                            substring(v_detail FROM 'current=([0-9]+)')::bigint,
                            strpos(v_detail, 'origin=other') > 0;
        RETURN;
    END;
    RETURN QUERY SELECT 'ok'::text, p_token, false;
END
$$;

-- Every guard trigger is re-installed from guard_trigger_ddl, in its mode.
DO $$
DECLARE
    v record;
BEGIN
    FOR v IN SELECT t.tgrelid::regclass AS rel, pgfence.trigger_mode(t.tgnargs, t.tgargs) AS mode
               FROM pg_trigger t
              WHERE t.tgname = 'pgfence_guard' AND NOT t.tgisinternal
              ORDER BY t.tgrelid
    LOOP
        PERFORM pgfence.install_guard_trigger(v.rel, v.mode);
    END LOOP;
END
$$;

-- The rejecting statement's own audit row names a duplicate token or a sealed row in its
-- `reason`, as the library's does (NULL for a plain stale rejection).
DROP FUNCTION IF EXISTS pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean);
CREATE OR REPLACE FUNCTION pgfence.record_rejection(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_lock_timeout_ms integer,
    p_other_counter boolean,
    p_reason text
) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
BEGIN
    -- Bounds the wait for the audit table. Local to the calling statement's transaction,
    -- which is that statement alone.
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::pg_catalog.text, true);
    PERFORM pgfence.append_audit(p_resource, p_table, p_key, p_presented, p_current, p_holder,
                                 p_operation, p_other_counter, p_reason);
    RETURN '';
END
$$;
REVOKE ALL ON FUNCTION
    pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean, text)
    FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    pgfence.record_rejection(text, text, text, bigint, bigint, text, text, integer, boolean, text)
    TO PUBLIC;
