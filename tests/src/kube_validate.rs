//! Kubernetes' own schemas, strict, for objects the tests produce (rendered manifests, pods the
//! webhook patched): PyPI `kubernetes-validate` (installed by scripts/setup) run on the venv's
//! Python. Strict mode is the one that rejects unknown fields.

use std::io::Write;

use crate::artefacts::Artefacts;

/// The oldest version the manifests support (native sidecars need ≥ 1.28; 1.29 has them on by
/// default) and the newest whose schemas the pinned kubernetes-validate ships.
pub const VERSIONS: &[&str] = &["1.29", "1.37"];

/// Validates each object against Kubernetes `version`'s schema, strict. `Err` lists every
/// failure with the object's kind/name.
pub fn validate(objects: &[serde_json::Value], version: &str) -> Result<(), String> {
    let python = Artefacts::require_python();
    let mut file = tempfile::NamedTempFile::new().map_err(|e| e.to_string())?;
    serde_json::to_writer(&mut file, objects).map_err(|e| e.to_string())?;
    file.flush().map_err(|e| e.to_string())?;
    let script = r#"
import json, sys
import kubernetes_validate as kv
objs = json.load(open(sys.argv[1]))
bad = []
for o in objs:
    name = f"{o.get('kind')}/{o.get('metadata', {}).get('name')}"
    try:
        kv.validate(o, sys.argv[2], strict=True)
    except Exception as e:  # ValidationError, InvalidSchemaError, VersionNotSupportedError
        bad.append(f"{name}: {type(e).__name__}: {e}")
print("\n".join(bad))
sys.exit(1 if bad else 0)
"#;
    let out = std::process::Command::new(python)
        .arg("-c")
        .arg(script)
        .arg(file.path())
        .arg(version)
        .output()
        .map_err(|e| format!("running kubernetes-validate: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "Kubernetes {version} schema (strict):\n{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}
