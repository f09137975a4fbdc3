-- Records one rejected write in pgfence.audit from inside the statement that rejected it.
--
-- The repository calls this only when its statement is a transaction of its own (a write
-- sent straight to a pool: only the client knows), so the row commits with the rejection and
-- no caller transaction can roll it back; on a connection, which may be inside a caller's
-- transaction, the library writes the row through its own pool instead, as before.
--
-- It never fails the rejecting statement: any error (the audit table locked past
-- p_lock_timeout_ms, a missing privilege) is caught and returned as text, and the library
-- reports it as an audit failure next to the StaleToken error. Returns '' when the row was
-- written.
CREATE FUNCTION pgfence.record_rejection(
    p_resource text,
    p_table text,
    p_key text,
    p_presented bigint,
    p_current bigint,
    p_holder text,
    p_operation text,
    p_lock_timeout_ms integer
) RETURNS text
LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp
AS $$
DECLARE
    v_lock_timeout text := pg_catalog.current_setting('lock_timeout');
BEGIN
    -- Bounds the wait for the audit table; put back before returning (an error rolls it back).
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::pg_catalog.text, true);
    INSERT INTO pgfence.audit (resource, table_name, row_key, presented, current, holder, operation)
    VALUES (p_resource, p_table, p_key, p_presented, p_current, p_holder, p_operation);
    PERFORM pg_catalog.set_config('lock_timeout', v_lock_timeout, true);
    RETURN '';
EXCEPTION WHEN OTHERS THEN
    RETURN SQLERRM;
END
$$;
