	vmovdqu8	(%r10,%rax), %ymm5
	vmovdqu	(%r8,%rax), %ymm0
	vpmovsxbw	(%r10,%rax), %zmm22
	vpandd	0(%r13,%rax,2), %zmm8, %zmm4
	vptestnmb	%ymm17, %ymm5, %k0
	vpmovzxbw	%ymm0, %zmm2
	vpslld	$16, 0(%r13,%rax,2), %zmm3
	vpandd	(%r12,%rax,2), %zmm8, %zmm24
	vpslld	$20, %zmm22, %zmm23
	vpslld	$19, %zmm2, %zmm20
	vpslld	$16, (%r12,%rax,2), %zmm18
	vpslld	$4, %zmm22, %zmm22
	vpslld	$3, %zmm2, %zmm2
	movl	$-16, %edx
	vmovaps	(%rdi), %zmm19
	vmovaps	256(%rdi), %zmm21
	vpbroadcastb	%edx, %ymm1
	vptestnmb	%ymm1, %ymm0, %k0
	vmovaps	64(%rdi), %zmm1
	vmulps	%zmm3, %zmm19, %zmm5
	vmulps	%zmm18, %zmm21, %zmm18
	vmulps	%zmm3, %zmm1, %zmm0
	vmulps	%zmm3, %zmm0, %zmm3
	vmovdqa32	%zmm23, %zmm0
	vpternlogd	$234, %zmm6, %zmm16, %zmm0
	vmovdqa32	%zmm0, %zmm25
	vpternlogd	$234, %zmm6, %zmm14, %zmm20
	vfmadd231ps	%zmm0, %zmm13, %zmm5
	vmovdqa32	%zmm20, %zmm0
	vmovaps	320(%rdi), %zmm23
	vmulps	%zmm0, %zmm12, %zmm0
	vmovaps	384(%rdi), %zmm20
	vmulps	%zmm4, %zmm1, %zmm1
	vmulps	%zmm24, %zmm21, %zmm21
	vmovdqa32	%zmm22, %zmm24
	vmulps	%zmm4, %zmm19, %zmm19
	vpternlogd	$234, %zmm6, %zmm16, %zmm24
	vfmadd132ps	%zmm0, %zmm3, %zmm0
	vmovaps	448(%rdi), %zmm3
	vmulps	%zmm4, %zmm1, %zmm4
	vsqrtps	%zmm0, %zmm0
	vmovaps	%zmm0, %zmm25
	vfmadd132ps	%zmm3, %zmm23, %zmm25
	vdivps	%zmm25, %zmm5, %zmm25
	vfmadd132ps	%zmm20, %zmm18, %zmm25
	vpsrld	$16, %zmm9, %zmm18
	vpaddd	%zmm25, %zmm18, %zmm18
	vfmadd231ps	%zmm24, %zmm13, %zmm19
	vpternlogd	$234, %zmm6, %zmm14, %zmm2
	vmovdqa32	%zmm2, %zmm1
	vmulps	%zmm1, %zmm12, %zmm1
	vmovaps	%zmm20, %zmm2
	movl	$-957401568, %edx
	vmovaps	%zmm0, (%rcx,%rax,4)
	vpsrld	$16, %zmm18, %zmm18
	vmovaps	%zmm5, (%rsi,%rax,4)
	vrangeps	$11, %zmm19, %zmm5, %zmm5
	vrangeps	$11, %zmm5, %zmm11, %zmm11
	vmovaps	%zmm19, 64(%rsi,%rax,4)
	vfmadd132ps	%zmm1, %zmm4, %zmm1
	vpsrld	$16, %zmm7, %zmm4
	vsqrtps	%zmm1, %zmm1
	vfmadd132ps	%zmm1, %zmm23, %zmm3
	vmaxps	%zmm1, %zmm0, %zmm0
	vmovaps	%zmm1, 64(%rcx,%rax,4)
	vmaxps	%zmm0, %zmm10, %zmm10
	vdivps	%zmm3, %zmm19, %zmm3
	vfmadd132ps	%zmm3, %zmm21, %zmm2
	vpbroadcastd	%edx, %zmm3
	vpaddd	%zmm9, %zmm3, %zmm9
	vpaddd	%zmm7, %zmm3, %zmm7
	vmovdqa32	%zmm8, %zmm3
	vpaddd	%zmm2, %zmm4, %zmm2
	vpternlogd	$202, %zmm18, %zmm2, %zmm3
	vmovdqu64	%zmm3, (%r12,%rax,2)
	vmovdqu64	%zmm3, (%r9,%rax,2)
