// The FusedElementwise program language (docs/program-language.md): parsed form and parser.
#ifndef ONNXFUSE_PROGRAM_H_
#define ONNXFUSE_PROGRAM_H_

#include <cstdint>
#include <string>
#include <vector>

namespace onnxfuse {

enum class DType : int { F32 = 0, F16, BF16, I32, I64, BOOL };
constexpr int kNumDTypes = 6;

const char* dtype_name(DType t);
bool dtype_from_name(const std::string& s, DType* out);
bool is_float(DType t);   // float32, float16, bfloat16
bool is_int(DType t);     // int32, int64
size_t dtype_size(DType t);
int dtype_to_onnx(DType t);            // ONNX TensorProto element type
bool dtype_from_onnx(int onnx, DType* out);

enum class Op : int {
  Add, Sub, Mul, Div, Pow, Min, Max,
  Neg, Abs, Sign,
  Exp, Log, Sqrt, Reciprocal, Sin, Cos, Tanh, Erf, Floor, Ceil, Round,
  Sigmoid, Relu, Softplus, Softsign, Mish, HardSwish,
  LeakyRelu, Elu, Celu, Selu, HardSigmoid, Gelu, Clip,
  Identity, Cast, Where,
  Equal, Less, LessOrEqual, Greater, GreaterOrEqual,
  Not, And, Or, Xor,
  NumOps
};

struct OpInfo {
  const char* name;       // ONNX op name, as written in programs
  int arity;
  const char* cfunc;      // function in ops.h (CUDA codegen and CPU kernel share it)
};
const OpInfo& op_info(Op op);

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
  double a = 0.0, b = 0.0;   // numeric attributes (alpha, beta/gamma, min, max); see parser
  DType to = DType::F32;  // Cast
  bool approximate_tanh = false;  // Gelu
  int64_t ilo = 0, ihi = 0;       // Clip on integers: bounds as integers
};

struct Program {
  int version = 1;
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
