-- pgfence.guard refuses tables in pgfence's own schema and in the system schemas: guarding
-- pgfence.audit (or a catalog) would break pgfence itself. SQLSTATE PF003.
CREATE OR REPLACE FUNCTION pgfence.guard(p_schema text, p_table text) RETURNS boolean
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_rel regclass;
    col_type text;
    col_notnull boolean;
    changed boolean := false;
BEGIN
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

    IF NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgrelid = v_rel AND tgname = 'pgfence_guard') THEN
        EXECUTE format(
            'CREATE TRIGGER pgfence_guard BEFORE UPDATE ON %s FOR EACH ROW '
            'WHEN (NEW.fence OPERATOR(pg_catalog.<=) OLD.fence) '
            'EXECUTE FUNCTION pgfence.reject_stale_update()', v_rel);
        changed := true;
    END IF;
    RETURN changed;
END
$$;
