//! On-disk cubin cache shared by every process of the user.
//!
//! Keyed by a hash of everything that changes the machine code (source and
//! headers, options, NVRTC version, arch). Files are written to a temporary
//! name and renamed, so ranks that compile the same kernel at once never read
//! a half-written cubin.

use crate::error::Result;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// Bumped when the layout of the cache changes.
const LAYOUT: &str = "cubin-v1";

pub fn cache_dir() -> PathBuf {
    let root = match std::env::var_os("FLASHOVERLAP_CACHE_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => {
            let home = std::env::var_os("HOME")
                .map(PathBuf::from)
                .unwrap_or_else(std::env::temp_dir);
            home.join(".cache").join("flashoverlap")
        }
    };
    root.join(LAYOUT)
}

pub fn key(parts: &[&[u8]]) -> String {
    let mut h = Sha256::new();
    for p in parts {
        // Length-prefix each part so that ("ab","c") and ("a","bc") differ.
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

fn looks_like_cubin(bytes: &[u8]) -> bool {
    bytes.len() > 4 && &bytes[..4] == b"\x7fELF"
}

/// Returns the cached cubin for `key`, or runs `compile` and stores it. A
/// cache that cannot be written is not an error: the cubin is still returned.
pub fn get_or_compile(key: &str, compile: impl FnOnce() -> Result<Vec<u8>>) -> Result<Vec<u8>> {
    let dir = cache_dir();
    let path = dir.join(format!("{key}.cubin"));
    if let Ok(bytes) = std::fs::read(&path) {
        if looks_like_cubin(&bytes) {
            return Ok(bytes);
        }
    }
    let cubin = compile()?;
    if std::fs::create_dir_all(&dir).is_ok() {
        let tmp = dir.join(format!(
            ".{key}.{}.{:?}.tmp",
            std::process::id(),
            std::thread::current().id()
        ));
        if std::fs::write(&tmp, &cubin).is_ok() && std::fs::rename(&tmp, &path).is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
    }
    Ok(cubin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn key_separates_parts() {
        assert_ne!(key(&[b"ab", b"c"]), key(&[b"a", b"bc"]));
        assert_eq!(key(&[b"x"]), key(&[b"x"]));
        assert_eq!(key(&[b"x"]).len(), 64);
    }

    #[test]
    fn stores_then_reuses_without_compiling() {
        let dir = std::env::temp_dir().join(format!("fo-cache-test-{}", std::process::id()));
        std::env::set_var("FLASHOVERLAP_CACHE_DIR", &dir);
        let fake = b"\x7fELFcubin".to_vec();
        let k = key(&[b"stores_then_reuses"]);
        let first = get_or_compile(&k, || Ok(fake.clone())).unwrap();
        assert_eq!(first, fake);
        let second = get_or_compile(&k, || panic!("must come from the cache")).unwrap();
        assert_eq!(second, fake);
        // A corrupt entry is recompiled, not returned.
        std::fs::write(cache_dir().join(format!("{k}.cubin")), b"junk").unwrap();
        let third = get_or_compile(&k, || Ok(fake.clone())).unwrap();
        assert_eq!(third, fake);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
