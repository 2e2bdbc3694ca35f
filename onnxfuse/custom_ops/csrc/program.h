// The FusedElementwise program language (docs/program-language.md): parsed form and parser.
#ifndef ONNXFUSE_PROGRAM_H_
#define ONNXFUSE_PROGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

#include "op_table.gen.h"

namespace onnxfuse {

const char* dtype_name(DType t);
bool dtype_from_name(const std::string& s, DType* out);
bool is_float(DType t);   // float32, float16, bfloat16
bool is_int(DType t);     // int32, int64
size_t dtype_size(DType t);
int dtype_to_onnx(DType t);            // ONNX TensorProto element type
bool dtype_from_onnx(int onnx, DType* out);

// Ops, their rows (OpInfo: name, arity, ops.h function, dtypes, result rule, attributes, form,
// fast functions) and the language version come from op_table.gen.h, generated from
// expr.OP_TABLE by tools/gen_op_table.py.
inline const OpInfo& op_info(Op op) { return kOps[static_cast<int>(op)]; }

struct Value {
  enum Kind { kInput, kConst, kOp } kind;
  std::string name;
  DType dtype;
  int input_index = -1;   // kInput
  double fconst = 0.0;    // kConst, float dtypes (already rounded to the storage dtype)
  int64_t iconst = 0;     // kConst, int and bool dtypes
};

struct Instr {
  Op op;
  int result;             // value index
  std::vector<int> args;  // value indices
  double a = 0.0, b = 0.0;   // numeric attributes in row order (alpha, beta/gamma, min, max)
  DType to = DType::F32;  // Cast
  bool approximate_tanh = false;  // Gelu
  int64_t ilo = 0, ihi = 0;       // Clip on integers: bounds as integers
};

struct Program {
  int version = kLanguageVersion;
  std::vector<Value> values;
  std::vector<Instr> instrs;
  std::vector<int> inputs;    // value index of input i
  std::vector<int> outputs;   // value index of output j (may repeat; may be an input or const)
  std::string text;           // original text
};

// Parses `text`. On failure returns false and sets *err to "line N: message".
bool parse_program(const std::string& text, Program* out, std::string* err);

}  // namespace onnxfuse

#endif  // ONNXFUSE_PROGRAM_H_
