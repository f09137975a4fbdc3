-- Records one rejected write in pgfence.audit from inside the statement that rejected it.
--
-- The repository calls this only when its statement is a transaction of its own (a write
-- sent straight to a pool: only the client knows), so the row commits with the rejection and
-- no caller transaction can roll it back; on a connection, which may be inside a caller's
-- transaction, the library writes the row through its own pool instead, as before.
--
-- It does not catch errors: a subtransaction (EXCEPTION block) made every audited rejection
-- about a quarter dearer. If the insert fails (the audit table locked past
-- p_lock_timeout_ms, a missing privilege), the statement fails; the library recognises this
-- function in the error's context, explains the rejection again without it and reports the
-- audit failure next to the StaleToken error, which it never hides. Returns ''.
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
BEGIN
    -- Bounds the wait for the audit table. Local to the calling statement's transaction,
    -- which is that statement alone.
    PERFORM pg_catalog.set_config('lock_timeout', p_lock_timeout_ms::pg_catalog.text, true);
    INSERT INTO pgfence.audit (resource, table_name, row_key, presented, current, holder, operation)
    VALUES (p_resource, p_table, p_key, p_presented, p_current, p_holder, p_operation);
    RETURN '';
END
$$;
