//! The safetensors file layout: building a header for a set of tensors and parsing/validating
//! the header of an existing file.
//!
//! Layout (identical to safetensors):
//! ```text
//! [u64 little-endian N][N bytes of JSON header, space padded to a multiple of 8][data]
//! ```
//! The JSON header maps tensor names to `{dtype, shape, data_offsets: [begin, end]}` (offsets
//! relative to the start of the data section) and has an optional `__metadata__` str->str map.
//! fastckpt stores the crc32c of every tensor as a JSON string under the metadata key
//! [`CHECKSUM_KEY`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// Metadata key holding `{"tensor name": "crc32c as 8 hex digits", ...}` as a JSON string.
pub const CHECKSUM_KEY: &str = "fastckpt.crc32c";
/// The key safetensors reserves for user metadata.
pub const METADATA_KEY: &str = "__metadata__";
/// Largest header we accept (safetensors uses the same order of magnitude). A file claiming a
/// larger header is refused before anything is allocated.
pub const MAX_HEADER_LEN: u64 = 100 * 1024 * 1024;
/// Length of the little-endian header-size prefix.
pub const PREFIX_LEN: u64 = 8;

/// Element types safetensors knows, with their on-disk names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    U16,
    I16,
    U32,
    I32,
    U64,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    C64,
    F8E4M3,
    F8E5M2,
}

impl Dtype {
    /// Every dtype, for tests and for listing in errors.
    pub const ALL: [Dtype; 16] = [
        Dtype::Bool,
        Dtype::U8,
        Dtype::I8,
        Dtype::U16,
        Dtype::I16,
        Dtype::U32,
        Dtype::I32,
        Dtype::U64,
        Dtype::I64,
        Dtype::F16,
        Dtype::Bf16,
        Dtype::F32,
        Dtype::F64,
        Dtype::C64,
        Dtype::F8E4M3,
        Dtype::F8E5M2,
    ];

    /// The safetensors name (`"F32"`, `"BF16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            Dtype::Bool => "BOOL",
            Dtype::U8 => "U8",
            Dtype::I8 => "I8",
            Dtype::U16 => "U16",
            Dtype::I16 => "I16",
            Dtype::U32 => "U32",
            Dtype::I32 => "I32",
            Dtype::U64 => "U64",
            Dtype::I64 => "I64",
            Dtype::F16 => "F16",
            Dtype::Bf16 => "BF16",
            Dtype::F32 => "F32",
            Dtype::F64 => "F64",
            Dtype::C64 => "C64",
            Dtype::F8E4M3 => "F8_E4M3",
            Dtype::F8E5M2 => "F8_E5M2",
        }
    }

    /// Parses a safetensors dtype name.
    pub fn from_name(name: &str) -> Option<Dtype> {
        Dtype::ALL.into_iter().find(|dtype| dtype.name() == name)
    }

    /// Bytes per element.
    pub fn size(self) -> u64 {
        match self {
            Dtype::Bool | Dtype::U8 | Dtype::I8 | Dtype::F8E4M3 | Dtype::F8E5M2 => 1,
            Dtype::U16 | Dtype::I16 | Dtype::F16 | Dtype::Bf16 => 2,
            Dtype::U32 | Dtype::I32 | Dtype::F32 => 4,
            Dtype::U64 | Dtype::I64 | Dtype::F64 | Dtype::C64 => 8,
        }
    }
}

/// Number of bytes a tensor of `dtype` and `shape` occupies, or None on overflow.
pub fn tensor_nbytes(dtype: Dtype, shape: &[u64]) -> Option<u64> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &dim| acc.checked_mul(dim))
}

/// One tensor as described by the header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    /// Byte range inside the data section.
    pub begin: u64,
    pub end: u64,
}

impl TensorInfo {
    /// Size of the tensor's bytes.
    pub fn nbytes(&self) -> u64 {
        self.end - self.begin
    }
}

/// A tensor to be laid out by [`plan_layout`]: name, dtype and shape (its bytes come later).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorDesc {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
}

/// A parsed, validated header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// Tensors in data-section order.
    pub tensors: Vec<TensorInfo>,
    /// User metadata, without fastckpt's checksum entry.
    pub metadata: BTreeMap<String, String>,
    /// crc32c per tensor name, when the file was written by fastckpt.
    pub checksums: HashMap<String, u32>,
    /// Absolute file offset where the data section starts.
    pub data_start: u64,
}

impl Header {
    /// Total file length this header describes.
    pub fn file_len(&self) -> u64 {
        self.data_start + self.tensors.last().map_or(0, |t| t.end)
    }

    /// Looks a tensor up by name.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }
}

/// Validates a user metadata map (str -> str, reserved keys refused).
fn check_metadata(metadata: &BTreeMap<String, String>) -> Result<()> {
    if metadata.contains_key(CHECKSUM_KEY) {
        return Err(Error::InvalidArgument(format!(
            "metadata key `{CHECKSUM_KEY}` is reserved for fastckpt's checksums; rename it"
        )));
    }
    Ok(())
}

/// Orders tensors the way safetensors does (larger element alignment first, then by name) so
/// that every tensor starts at a multiple of its element size, and assigns data offsets.
///
/// Returns the tensors in data order with their offsets filled in.
pub fn plan_layout(descs: Vec<TensorDesc>) -> Result<Vec<TensorInfo>> {
    let mut seen = std::collections::HashSet::new();
    for desc in &descs {
        if desc.name == METADATA_KEY {
            return Err(Error::InvalidArgument(format!(
                "tensor name `{METADATA_KEY}` is reserved by the safetensors format; rename it"
            )));
        }
        if !seen.insert(desc.name.as_str()) {
            return Err(Error::InvalidArgument(format!(
                "tensor name `{}` appears twice; names must be unique",
                desc.name
            )));
        }
    }
    let mut descs = descs;
    descs.sort_by(|a, b| {
        b.dtype
            .size()
            .cmp(&a.dtype.size())
            .then_with(|| a.name.cmp(&b.name))
    });
    let mut offset = 0u64;
    let mut tensors = Vec::with_capacity(descs.len());
    for desc in descs {
        let nbytes = tensor_nbytes(desc.dtype, &desc.shape).ok_or_else(|| {
            Error::InvalidArgument(format!("tensor `{}`: size overflows u64", desc.name))
        })?;
        let end = offset
            .checked_add(nbytes)
            .ok_or_else(|| Error::InvalidArgument("total tensor size overflows u64".to_string()))?;
        tensors.push(TensorInfo {
            name: desc.name,
            dtype: desc.dtype,
            shape: desc.shape,
            begin: offset,
            end,
        });
        offset = end;
    }
    Ok(tensors)
}

/// What [`encode_header`] writes into the checksum metadata entry.
#[derive(Debug, Clone, Copy)]
pub enum Checksums<'a> {
    /// No checksum entry (checksums disabled).
    Omitted,
    /// Zeros of the final width, so the header length is known before hashing.
    Placeholder,
    /// The real crc32c of each tensor, in `tensors` order.
    Values(&'a [u32]),
}

/// Serializes the header (prefix + padded JSON) for `tensors` laid out by [`plan_layout`].
///
/// With [`Checksums::Placeholder`] every checksum is written as a placeholder of the same width, so
/// the header length is known before the data is hashed; the final header (with the real
/// checksums) then has exactly the same length and overwrites the placeholder in place.
pub fn encode_header(
    tensors: &[TensorInfo],
    metadata: &BTreeMap<String, String>,
    checksums: Checksums,
) -> Result<Vec<u8>> {
    check_metadata(metadata)?;
    let mut meta = Map::new();
    for (key, value) in metadata {
        meta.insert(key.clone(), Value::String(value.clone()));
    }
    let values = match checksums {
        Checksums::Omitted => None,
        Checksums::Placeholder => Some(None),
        Checksums::Values(crcs) => Some(Some(crcs)),
    };
    if let Some(crcs) = values {
        let mut crc_map = Map::new();
        for (i, tensor) in tensors.iter().enumerate() {
            let crc = crcs.map_or(0, |crcs| crcs[i]);
            crc_map.insert(tensor.name.clone(), Value::String(format!("{crc:08x}")));
        }
        meta.insert(
            CHECKSUM_KEY.to_string(),
            Value::String(Value::Object(crc_map).to_string()),
        );
    }
    let mut root = Map::new();
    root.insert(METADATA_KEY.to_string(), Value::Object(meta));
    for tensor in tensors {
        let mut entry = Map::new();
        entry.insert("dtype".into(), Value::String(tensor.dtype.name().into()));
        entry.insert(
            "shape".into(),
            Value::Array(tensor.shape.iter().map(|&d| Value::from(d)).collect()),
        );
        entry.insert(
            "data_offsets".into(),
            Value::Array(vec![Value::from(tensor.begin), Value::from(tensor.end)]),
        );
        root.insert(tensor.name.clone(), Value::Object(entry));
    }
    let mut json = Value::Object(root).to_string().into_bytes();
    // Pad with spaces so the data section starts 8-byte aligned (valid JSON whitespace).
    let padded = json.len().div_ceil(8) * 8;
    json.resize(padded, b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    Ok(out)
}

/// Reads the header length from the 8-byte prefix and checks it against the cap and the file.
pub fn parse_prefix(path: &Path, prefix: &[u8; 8], file_len: u64) -> Result<u64> {
    let header_len = u64::from_le_bytes(*prefix);
    if header_len > MAX_HEADER_LEN {
        return Err(Error::format(
            path,
            "header_length",
            format!(
                "declares a {header_len}-byte header, over the {MAX_HEADER_LEN}-byte limit; \
                 this is not a safetensors file or it is corrupt"
            ),
        ));
    }
    if PREFIX_LEN + header_len > file_len {
        return Err(Error::format(
            path,
            "header_length",
            format!(
                "declares a {header_len}-byte header but the file has only {file_len} bytes; \
                 the file is truncated"
            ),
        ));
    }
    Ok(header_len)
}

fn parse_shape(path: &Path, name: &str, value: Option<&Value>) -> Result<Vec<u64>> {
    let field = format!("{name}.shape");
    let dims = value
        .and_then(Value::as_array)
        .ok_or_else(|| Error::format(path, &field, "missing or not a list"))?;
    dims.iter()
        .map(|dim| {
            dim.as_u64()
                .ok_or_else(|| Error::format(path, &field, "dimensions must be integers >= 0"))
        })
        .collect()
}

fn parse_offsets(path: &Path, name: &str, value: Option<&Value>) -> Result<(u64, u64)> {
    let field = format!("{name}.data_offsets");
    let pair = value
        .and_then(Value::as_array)
        .filter(|pair| pair.len() == 2)
        .ok_or_else(|| Error::format(path, &field, "missing or not a [begin, end] pair"))?;
    match (pair[0].as_u64(), pair[1].as_u64()) {
        (Some(begin), Some(end)) if begin <= end => Ok((begin, end)),
        _ => Err(Error::format(
            path,
            &field,
            "offsets must be integers with begin <= end",
        )),
    }
}

fn parse_checksums(path: &Path, text: &str) -> Result<HashMap<String, u32>> {
    let bad = |msg: &str| Error::format(path, CHECKSUM_KEY, msg.to_string());
    let value: Value = serde_json::from_str(text).map_err(|_| bad("not valid JSON"))?;
    let object = value.as_object().ok_or_else(|| bad("not a JSON object"))?;
    object
        .iter()
        .map(|(name, crc)| {
            let hex = crc.as_str().filter(|hex| hex.len() == 8);
            let crc = hex
                .and_then(|hex| u32::from_str_radix(hex, 16).ok())
                .ok_or_else(|| bad(&format!("entry `{name}` is not 8 hex digits")))?;
            Ok((name.clone(), crc))
        })
        .collect()
}

fn parse_metadata(
    path: &Path,
    value: &Value,
) -> Result<(BTreeMap<String, String>, HashMap<String, u32>)> {
    let object = value
        .as_object()
        .ok_or_else(|| Error::format(path, METADATA_KEY, "must be a str -> str mapping"))?;
    let mut metadata = BTreeMap::new();
    let mut checksums = HashMap::new();
    for (key, value) in object {
        let text = value.as_str().ok_or_else(|| {
            Error::format(
                path,
                format!("{METADATA_KEY}.{key}"),
                "metadata values must be strings",
            )
        })?;
        if key == CHECKSUM_KEY {
            checksums = parse_checksums(path, text)?;
        } else {
            metadata.insert(key.clone(), text.to_string());
        }
    }
    Ok((metadata, checksums))
}

/// Parses and validates the JSON header of a file of `file_len` bytes.
///
/// Checks: valid UTF-8 JSON object; every entry has a known dtype, integer shape and offsets;
/// `end - begin == dtype size x numel`; tensors tile the data section without gaps or
/// overlaps from offset 0; the data section ends exactly at the end of the file (a shorter
/// file is truncated, a longer one is not something we wrote); checksums name real tensors.
pub fn parse_header(path: &Path, json: &[u8], file_len: u64) -> Result<Header> {
    let data_start = PREFIX_LEN + json.len() as u64;
    let text = std::str::from_utf8(json)
        .map_err(|_| Error::format(path, "header", "header is not valid UTF-8"))?;
    let root: Value = serde_json::from_str(text.trim_end_matches(' '))
        .map_err(|err| Error::format(path, "header", format!("invalid JSON: {err}")))?;
    let root = root
        .as_object()
        .ok_or_else(|| Error::format(path, "header", "header must be a JSON object"))?;
    let mut metadata = BTreeMap::new();
    let mut checksums = HashMap::new();
    let mut tensors = Vec::with_capacity(root.len());
    for (name, entry) in root {
        if name == METADATA_KEY {
            (metadata, checksums) = parse_metadata(path, entry)?;
            continue;
        }
        let dtype_name = entry.get("dtype").and_then(Value::as_str).unwrap_or("");
        let dtype = Dtype::from_name(dtype_name).ok_or_else(|| {
            Error::format(
                path,
                format!("{name}.dtype"),
                format!("unknown dtype `{dtype_name}`"),
            )
        })?;
        let shape = parse_shape(path, name, entry.get("shape"))?;
        let (begin, end) = parse_offsets(path, name, entry.get("data_offsets"))?;
        let expected = tensor_nbytes(dtype, &shape)
            .ok_or_else(|| Error::format(path, format!("{name}.shape"), "size overflows u64"))?;
        if end - begin != expected {
            return Err(Error::format(
                path,
                format!("{name}.data_offsets"),
                format!(
                    "covers {} bytes but dtype {} x shape {:?} needs {expected}",
                    end - begin,
                    dtype.name(),
                    shape
                ),
            ));
        }
        tensors.push(TensorInfo {
            name: name.clone(),
            dtype,
            shape,
            begin,
            end,
        });
    }
    tensors.sort_by_key(|t| (t.begin, t.end));
    let mut cursor = 0u64;
    for tensor in &tensors {
        if tensor.begin != cursor {
            let what = if tensor.begin < cursor {
                "overlaps the previous tensor"
            } else {
                "leaves a gap after the previous tensor"
            };
            return Err(Error::format(
                path,
                format!("{}.data_offsets", tensor.name),
                format!("starts at {} which {what} (ends at {cursor})", tensor.begin),
            ));
        }
        cursor = tensor.end;
    }
    let described = data_start.saturating_add(cursor);
    if described != file_len {
        let problem = if described > file_len {
            "the file is truncated"
        } else {
            "the file has trailing bytes the header does not describe"
        };
        return Err(Error::format(
            path,
            "data_offsets",
            format!("header describes {described} bytes but the file has {file_len}: {problem}"),
        ));
    }
    if let Some(unknown) = checksums.keys().find(|name| !root.contains_key(*name)) {
        return Err(Error::format(
            path,
            CHECKSUM_KEY,
            format!("checksum for unknown tensor `{unknown}`"),
        ));
    }
    Ok(Header {
        tensors,
        metadata,
        checksums,
        data_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(name: &str, dtype: Dtype, shape: &[u64]) -> TensorDesc {
        TensorDesc {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
        }
    }

    fn encode(descs: Vec<TensorDesc>, crcs: Option<&[u32]>) -> (Vec<TensorInfo>, Vec<u8>) {
        let tensors = plan_layout(descs).unwrap();
        let header = encode_header(
            &tensors,
            &BTreeMap::new(),
            crcs.map_or(Checksums::Placeholder, Checksums::Values),
        )
        .unwrap();
        (tensors, header)
    }

    fn parse(bytes: &[u8]) -> Result<Header> {
        let path = Path::new("t.safetensors");
        let prefix: [u8; 8] = bytes[..8].try_into().unwrap();
        let len = parse_prefix(path, &prefix, bytes.len() as u64)?;
        parse_header(path, &bytes[8..8 + len as usize], bytes.len() as u64)
    }

    fn file_with_data(header: &[u8], data_len: u64) -> Vec<u8> {
        let mut file = header.to_vec();
        file.resize(header.len() + data_len as usize, 0);
        file
    }

    #[test]
    fn dtype_names_round_trip_and_sizes() {
        for dtype in Dtype::ALL {
            assert_eq!(Dtype::from_name(dtype.name()), Some(dtype));
        }
        assert_eq!(Dtype::Bf16.size(), 2);
        assert_eq!(Dtype::F8E4M3.size(), 1);
        assert_eq!(Dtype::from_name("F128"), None);
    }

    #[test]
    fn layout_sorts_by_alignment_then_name_and_is_contiguous() {
        let tensors = plan_layout(vec![
            desc("b", Dtype::U8, &[3]),
            desc("a", Dtype::F64, &[2]),
            desc("c", Dtype::F32, &[]),
            desc("z", Dtype::F16, &[0, 4]),
        ])
        .unwrap();
        let names: Vec<_> = tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "c", "z", "b"]);
        assert_eq!((tensors[0].begin, tensors[0].end), (0, 16));
        assert_eq!((tensors[1].begin, tensors[1].end), (16, 20));
        assert_eq!((tensors[2].begin, tensors[2].end), (20, 20));
        assert_eq!((tensors[3].begin, tensors[3].end), (20, 23));
    }

    #[test]
    fn duplicate_and_reserved_names_are_refused() {
        let dup = plan_layout(vec![desc("a", Dtype::U8, &[1]), desc("a", Dtype::U8, &[1])]);
        assert!(matches!(dup, Err(Error::InvalidArgument(m)) if m.contains("twice")));
        let reserved = plan_layout(vec![desc(METADATA_KEY, Dtype::U8, &[1])]);
        assert!(matches!(reserved, Err(Error::InvalidArgument(_))));
    }

    #[test]
    fn header_is_padded_to_eight_and_placeholder_has_final_length() {
        let (tensors, placeholder) = encode(
            vec![desc("w", Dtype::F32, &[3, 3]), desc("b", Dtype::I64, &[3])],
            None,
        );
        let fin = encode_header(
            &tensors,
            &BTreeMap::new(),
            Checksums::Values(&[0xdeadbeef, 7]),
        )
        .unwrap();
        assert_eq!(placeholder.len(), fin.len());
        assert_eq!(fin.len() % 8, 0);
        let json_len = u64::from_le_bytes(fin[..8].try_into().unwrap());
        assert_eq!(json_len as usize, fin.len() - 8);
    }

    #[test]
    fn round_trip_header_with_metadata_and_checksums() {
        let tensors = plan_layout(vec![
            desc("w", Dtype::Bf16, &[2, 5]),
            desc("s", Dtype::Bool, &[]),
        ])
        .unwrap();
        let mut meta = BTreeMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let header = encode_header(&tensors, &meta, Checksums::Values(&[1, 0xffff_ffff])).unwrap();
        let file = file_with_data(&header, 21);
        let parsed = parse(&file).unwrap();
        assert_eq!(parsed.tensors, tensors);
        assert_eq!(parsed.metadata, meta);
        assert_eq!(parsed.checksums["w"], 1);
        assert_eq!(parsed.checksums["s"], 0xffff_ffff);
        assert_eq!(parsed.data_start as usize, header.len());
        assert_eq!(parsed.file_len(), file.len() as u64);
    }

    #[test]
    fn reserved_metadata_key_is_refused() {
        let mut meta = BTreeMap::new();
        meta.insert(CHECKSUM_KEY.to_string(), "x".to_string());
        assert!(encode_header(&[], &meta, Checksums::Omitted).is_err());
    }

    fn raw_file(json: &str, data_len: usize) -> Vec<u8> {
        let mut file = (json.len() as u64).to_le_bytes().to_vec();
        file.extend_from_slice(json.as_bytes());
        file.resize(file.len() + data_len, 0);
        file
    }

    fn format_field(result: Result<Header>) -> String {
        match result {
            Err(Error::Format { field, .. }) => field,
            other => panic!("expected a format error, got {other:?}"),
        }
    }

    #[test]
    fn malformed_headers_are_typed_errors_naming_the_field() {
        let cases: &[(&str, usize, &str)] = &[
            ("not json", 0, "header"),
            ("[1,2]", 0, "header"),
            (
                r#"{"a":{"dtype":"F99","shape":[1],"data_offsets":[0,4]}}"#,
                4,
                "a.dtype",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}"#,
                4,
                "a.shape",
            ),
            (
                r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#,
                4,
                "a.data_offsets",
            ),
            (r#"{"a":{"dtype":"F32","shape":[1]}}"#, 4, "a.data_offsets"),
            (
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
                4,
                "a.data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}"#,
                6,
                "b.data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[1,5]}}"#,
                5,
                "a.data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                3,
                "data_offsets",
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#,
                9,
                "data_offsets",
            ),
            (r#"{"__metadata__":{"k":1}}"#, 0, "__metadata__.k"),
            (
                r#"{"__metadata__":{"fastckpt.crc32c":"{\"zz\":\"00000000\"}"}}"#,
                0,
                CHECKSUM_KEY,
            ),
            (
                r#"{"__metadata__":{"fastckpt.crc32c":"nope"}}"#,
                0,
                CHECKSUM_KEY,
            ),
            (
                r#"{"a":{"dtype":"U8","shape":[18446744073709551615,2],"data_offsets":[0,4]}}"#,
                4,
                "a.shape",
            ),
        ];
        for (json, data_len, field) in cases {
            let got = format_field(parse(&raw_file(json, *data_len)));
            assert_eq!(&got, field, "for header {json}");
        }
    }

    #[test]
    fn huge_or_truncated_header_length_is_refused_without_allocating() {
        let path = Path::new("t");
        let huge = u64::MAX.to_le_bytes();
        assert!(matches!(
            parse_prefix(path, &huge, 100),
            Err(Error::Format { .. })
        ));
        let over_file = 50u64.to_le_bytes();
        assert!(matches!(
            parse_prefix(path, &over_file, 40),
            Err(Error::Format { .. })
        ));
        assert_eq!(parse_prefix(path, &32u64.to_le_bytes(), 40).unwrap(), 32);
    }

    #[test]
    fn empty_file_set_is_valid() {
        let (_, header) = encode(vec![], None);
        let parsed = parse(&header).unwrap();
        assert!(parsed.tensors.is_empty());
    }

    proptest::proptest! {
        #[test]
        fn any_layout_round_trips(shapes in proptest::collection::vec(
            (0usize..16, proptest::collection::vec(0u64..5, 0..4)), 0..12)) {
            let descs: Vec<_> = shapes.iter().enumerate().map(|(i, (d, shape))| {
                desc(&format!("t{i}"), Dtype::ALL[*d], shape)
            }).collect();
            let (tensors, header) = encode(descs, None);
            let data_len = tensors.last().map_or(0, |t| t.end);
            let parsed = parse(&file_with_data(&header, data_len)).unwrap();
            for t in &parsed.tensors {
                proptest::prop_assert_eq!(t.begin % t.dtype.size(), 0);
            }
            proptest::prop_assert_eq!(parsed.tensors.len(), tensors.len());
        }

        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..256)) {
            let path = Path::new("fuzz");
            let _ = parse_header(path, &bytes, bytes.len() as u64 + 8);
        }
    }

    /// Mutations of a real header: whatever the damage, parsing returns `Err` or a header that
    /// describes exactly the bytes present, and never panics or allocates what a length claims.
    mod mutated {
        use super::*;
        use proptest::prelude::*;

        /// A header fastckpt writes (several dtypes, a 0-d and a zero-size tensor, checksums,
        /// user metadata) followed by its data section.
        fn real_file() -> Vec<u8> {
            let tensors = plan_layout(vec![
                desc("weight", Dtype::F32, &[4, 3]),
                desc("bias", Dtype::Bf16, &[3]),
                desc("step", Dtype::I64, &[]),
                desc("mask", Dtype::Bool, &[0, 5]),
            ])
            .unwrap();
            let mut meta = BTreeMap::new();
            meta.insert("format".to_string(), "pt".to_string());
            let crcs: Vec<u32> = (0..tensors.len() as u32).map(|i| 0x1234_5678 ^ i).collect();
            let header = encode_header(&tensors, &meta, Checksums::Values(&crcs)).unwrap();
            file_with_data(&header, tensors.last().map_or(0, |t| t.end))
        }

        /// What `Reader::open` does with a whole file, for inputs of any length.
        fn parse_file(bytes: &[u8]) -> Result<Header> {
            let path = Path::new("mutated.safetensors");
            let file_len = bytes.len() as u64;
            let Some(prefix) = bytes.get(..8).and_then(|p| <[u8; 8]>::try_from(p).ok()) else {
                return Err(Error::format(
                    path,
                    "header_length",
                    "shorter than the prefix",
                ));
            };
            let len = parse_prefix(path, &prefix, file_len)?;
            parse_header(path, &bytes[8..8 + len as usize], file_len)
        }

        fn consistent(header: &Header, file_len: u64) -> std::result::Result<(), TestCaseError> {
            prop_assert_eq!(header.file_len(), file_len);
            let mut cursor = 0;
            for tensor in &header.tensors {
                prop_assert_eq!(tensor.begin, cursor);
                prop_assert_eq!(
                    Some(tensor.nbytes()),
                    tensor_nbytes(tensor.dtype, &tensor.shape)
                );
                cursor = tensor.end;
            }
            for name in header.checksums.keys() {
                prop_assert!(header.tensor(name).is_some());
            }
            Ok(())
        }

        #[test]
        fn the_unmutated_file_parses() {
            let file = real_file();
            let header = parse_file(&file).unwrap();
            assert_eq!(header.tensors.len(), 4);
            assert_eq!(header.file_len(), file.len() as u64);
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2048))]

            #[test]
            fn bit_flips_byte_changes_and_truncations_never_panic(
                flips in proptest::collection::vec((any::<usize>(), 0u8..8), 0..6),
                bytes in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..3),
                cut in proptest::option::of(any::<usize>()),
            ) {
                let mut file = real_file();
                let header_end = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
                for (position, bit) in flips {
                    file[position % header_end] ^= 1 << bit; // the prefix and the JSON header
                }
                for (position, byte) in bytes {
                    let i = position % file.len();
                    file[i] = byte;
                }
                if let Some(cut) = cut {
                    file.truncate(cut % (file.len() + 1));
                }
                if let Ok(header) = parse_file(&file) {
                    consistent(&header, file.len() as u64)?;
                }
            }

            #[test]
            fn declared_lengths_over_the_cap_are_refused(
                len in (MAX_HEADER_LEN + 1)..=u64::MAX,
                file_len in any::<u64>(),
            ) {
                let refused = parse_prefix(Path::new("huge"), &len.to_le_bytes(), file_len);
                let is_format_error = matches!(refused, Err(Error::Format { .. }));
                prop_assert!(is_format_error, "{:?}", refused);
            }

            #[test]
            fn declared_lengths_beyond_the_file_are_refused(
                file_len in 0u64..(1 << 40),
                excess in 1u64..(1 << 30),
            ) {
                let len = file_len.saturating_sub(PREFIX_LEN) + excess;
                let refused = parse_prefix(Path::new("short"), &len.to_le_bytes(), file_len);
                let is_format_error = matches!(refused, Err(Error::Format { .. }));
                prop_assert!(is_format_error, "{:?}", refused);
            }

            #[test]
            fn a_prefix_claiming_a_huge_length_fails_the_whole_file(
                len in (MAX_HEADER_LEN + 1)..=u64::MAX,
            ) {
                let mut file = real_file();
                file[..8].copy_from_slice(&len.to_le_bytes());
                let refused = parse_file(&file);
                let is_format_error = matches!(refused, Err(Error::Format { .. }));
                prop_assert!(is_format_error, "{:?}", refused);
            }
        }
    }
}
